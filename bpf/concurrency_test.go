//go:build linux

package bpf

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// blockWait bounds how long a test waits for an operation that must not be
// held up; it fails the test instead of hanging it.
const blockWait = 10 * time.Second

// pauseAttach makes the kernel attach on ifindex stop until the returned
// release is called; paused is closed once an attach is stopped there.
// Other interfaces' attaches run through.
func pauseAttach(t *testing.T, ifindex int) (paused <-chan struct{}, release func()) {
	t.Helper()
	p, r := make(chan struct{}), make(chan struct{})
	first := true
	attachHook = func(i int) {
		if i != ifindex || !first {
			return
		}
		first = false // only the ifindex's lock holder gets here
		close(p)
		<-r
	}
	released := false
	release = func() {
		if !released {
			released = true
			close(r)
		}
	}
	t.Cleanup(func() { release(); attachHook = nil })
	return p, release
}

// goAttach runs Attach in the host namespace in a goroutine; the channel
// receives its error.
func (h *host) goAttach(t *testing.T, d *Datapath, ep Endpoint) <-chan error {
	done := make(chan error, 1)
	go func() {
		var err error
		inNS(t, h.ns, func() error { err = d.Attach(ep); return nil })
		done <- err
	}()
	return done
}

func wait(t *testing.T, ch <-chan error, what string) {
	t.Helper()
	select {
	case err := <-ch:
		require.NoError(t, err, what)
	case <-time.After(blockWait):
		t.Fatalf("%s did not finish within %s", what, blockWait)
	}
}

// TestAttachDifferentInterfacesConcurrently stops an Attach on one host veth
// in the middle of its kernel attach and checks that an Attach on another
// veth completes meanwhile, in each attach mode; then both enforce.
func TestAttachDifferentInterfacesConcurrently(t *testing.T) {
	requireDatapath(t)
	for _, mode := range []string{AttachTCX, AttachTC} {
		t.Run(mode, func(t *testing.T) {
			h := newHost(t)
			a, b := h.addPod(t, 1), h.addPod(t, 2)
			dir := pinDir(t)
			d := openDatapath(t, dir)
			a.ep.Attach, b.ep.Attach = mode, mode

			paused, release := pauseAttach(t, a.ep.HostIfIndex)
			doneA := h.goAttach(t, d, a.ep)
			select {
			case <-paused:
			case err := <-doneA:
				t.Fatalf("Attach on A returned (%v) without reaching the hook", err)
			case <-time.After(blockWait):
				t.Fatal("Attach on A did not reach the kernel attach")
			}
			wait(t, h.goAttach(t, d, b.ep), "Attach on B while A's is paused")
			requireEntries(t, dir, b.ep)
			release()
			wait(t, doneA, "Attach on A")

			for _, p := range []*pod{a, b} {
				requireEntries(t, dir, p.ep)
				forged := token(t, "forged")
				p.sendFrame(t, udpFrame(p.hostMAC, p.mac, spoof4, recvV4, recvPort, forged))
				_, ok := h.recv4.got(forged, absentWait)
				require.False(t, ok, "pod %s's spoofed frame passed", p.ep.HostIfName)
			}
		})
	}
}

// TestAttachSameInterfaceSerialized stops an Attach in its kernel attach and
// starts a second Attach of the same host veth, with other addresses: the
// second waits on the interface's lock until the first finishes, then
// replaces its addresses.
func TestAttachSameInterfaceSerialized(t *testing.T) {
	requireDatapath(t)
	h := newHost(t)
	p := h.addPod(t, 1)
	dir := pinDir(t)
	d := openDatapath(t, dir)
	first := p.ep
	first.IPs = first.IPs[:1]
	second := p.ep

	var entered int
	paused, release := pauseAttach(t, p.ep.HostIfIndex)
	inner := attachHook
	attachHook = func(i int) { entered++; inner(i) }
	done1 := h.goAttach(t, d, first)
	select {
	case <-paused:
	case <-time.After(blockWait):
		t.Fatal("the first Attach did not reach the kernel attach")
	}
	done2 := h.goAttach(t, d, second)
	// The second Attach has queued once it holds a reference to the
	// interface's lock; it must get no further while the first is paused.
	require.Eventually(t, func() bool { return d.ifLocks.Waiters(p.ep.HostIfIndex) == 2 },
		blockWait, time.Millisecond, "the second Attach never queued on the interface lock")
	select {
	case err := <-done2:
		t.Fatalf("the second Attach finished (%v) while the first held the interface", err)
	case <-time.After(absentWait):
	}
	require.Equal(t, 1, entered)
	release()
	wait(t, done1, "first Attach")
	wait(t, done2, "second Attach")
	require.Equal(t, 2, entered)
	requireEntries(t, dir, second)
	require.Zero(t, d.ifLocks.Waiters(p.ep.HostIfIndex), "lock entry not freed")
}

// TestCloseWaitsForAttach: Close waits for an Attach in flight, which
// completes, and calls after it fail with ErrClosed.
func TestCloseWaitsForAttach(t *testing.T) {
	requireDatapath(t)
	h := newHost(t)
	a, b := h.addPod(t, 1), h.addPod(t, 2)
	dir := pinDir(t)
	d := openDatapath(t, dir)

	paused, release := pauseAttach(t, a.ep.HostIfIndex)
	doneA := h.goAttach(t, d, a.ep)
	select {
	case <-paused:
	case <-time.After(blockWait):
		t.Fatal("Attach on A did not reach the kernel attach")
	}
	closed := make(chan error, 1)
	go func() { closed <- d.Close() }()
	select {
	case err := <-closed:
		t.Fatalf("Close returned (%v) while an Attach was in flight", err)
	case <-time.After(absentWait):
	}
	release()
	wait(t, doneA, "Attach on A")
	wait(t, closed, "Close")
	requireEntries(t, dir, a.ep)
	var err error
	inNS(t, h.ns, func() error { err = d.Attach(b.ep); return nil })
	require.ErrorIs(t, err, ErrClosed)
	require.ErrorIs(t, d.Disarm(a.ep), ErrClosed)
	_, err = d.Stats()
	require.ErrorIs(t, err, ErrClosed)
}

// TestConcurrentAttachDetach attaches eight endpoints at once, pairs of
// them sharing an endpoint ID (so a counters entry), then detaches one of
// each pair at once: the other keeps every entry, its counters included;
// then the rest, which leaves nothing but counter 0.
func TestConcurrentAttachDetach(t *testing.T) {
	requireDatapath(t)
	h := newHost(t)
	dir := pinDir(t)
	d := openDatapath(t, dir)
	var pods []*pod
	for i := 1; i <= 8; i++ {
		p := h.addPod(t, i)
		p.ep.ID = uint32(200 + (i+1)/2)
		if i%3 == 0 {
			p.ep.Attach = AttachTCX
		} else {
			p.ep.Attach = AttachTC
		}
		pods = append(pods, p)
	}
	each := func(ps []*pod, op func(Endpoint) error) {
		errs := make(chan error, len(ps))
		for _, p := range ps {
			go func() {
				var err error
				inNS(t, h.ns, func() error { err = op(p.ep); return nil })
				errs <- err
			}()
		}
		for range ps {
			wait(t, errs, "concurrent call")
		}
	}
	each(pods, d.Attach)
	for _, p := range pods {
		requireEntries(t, dir, p.ep)
	}
	var odd, even []*pod
	for i, p := range pods {
		if i%2 == 0 {
			odd = append(odd, p)
		} else {
			even = append(even, p)
		}
	}
	requireOwnersMatch(t, d)
	each(odd, d.Detach)
	for _, p := range even {
		requireEntries(t, dir, p.ep)
	}
	requireOwnersMatch(t, d)
	each(even, d.Detach)
	s := readPinned(t, dir)
	require.Empty(t, s.addrs)
	require.Empty(t, s.ifaces)
	require.Len(t, s.counters, 1)
	require.Contains(t, s.counters, uint32(0))
	requireOwnersMatch(t, d)
	for _, p := range pods {
		require.Empty(t, h.tcx(t, p.ep.HostIfIndex).programs)
		require.False(t, h.tc(t, p.ep.HostIfIndex).clsact)
	}
}
