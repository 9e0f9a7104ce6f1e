//go:build linux

package bpf

import (
	"crypto/rand"
	"errors"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/stretchr/testify/require"
)

// guard bounds a wait for something that must happen; it only turns a hang
// into a failure, the tests never wait it out on success.
const guard = 30 * time.Second

// announcements reads d's ring buffer into a channel until the test ends.
func announcements(tb testing.TB, d *Datapath) <-chan Announcement {
	tb.Helper()
	r, err := d.Announcements()
	require.NoError(tb, err)
	ch := make(chan Announcement, 64)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			a, err := r.Read()
			if err != nil {
				if !errors.Is(err, ErrClosed) {
					tb.Errorf("read announcements: %v", err)
				}
				return
			}
			ch <- a
		}
	}()
	tb.Cleanup(func() {
		require.NoError(tb, r.Close())
		<-done
	})
	return ch
}

func nextAnnouncement(tb testing.TB, ch <-chan Announcement) Announcement {
	tb.Helper()
	select {
	case a := <-ch:
		return a
	case <-time.After(guard):
		tb.Fatal("no announcement reported")
		return Announcement{}
	}
}

func randomMAC(tb testing.TB) net.HardwareAddr {
	tb.Helper()
	m := make(net.HardwareAddr, 6)
	_, err := rand.Read(m)
	require.NoError(tb, err)
	m[0] = m[0]&^1 | 2 // unicast, locally administered
	return m
}

// awaitVerdict waits until p's frame just sent is counted, and checks it
// was dropped (exactly one more drop) or passed (no drop).
func awaitVerdict(tb testing.TB, d *Datapath, p *pod, before Counters, drop bool) {
	tb.Helper()
	var now Counters
	require.Eventually(tb, func() bool {
		now = counters(tb, d, p.ep.ID)
		if drop {
			return now.DroppedPackets > before.DroppedPackets
		}
		return now.PassedPackets > before.PassedPackets
	}, guard, 2*time.Millisecond, "verdict counted")
	if drop {
		require.Equal(tb, before.DroppedPackets+1, now.DroppedPackets, "dropped")
	} else {
		require.Equal(tb, before.DroppedPackets, now.DroppedPackets, "nothing dropped")
	}
}

// TestAnnouncementEvents: on a watched host veth, a gratuitous ARP (request
// or reply), an unsolicited NA for an address of the endpoint and a RARP
// frame are reported in the ring buffer with the right fields; an ARP that
// is not gratuitous, a solicited NA, an announcement of an address the pod
// does not own, and anything on a veth that is not (or no longer) watched
// are not. Each frame's verdict is the one it has without a watch (RARP
// passes, spoofed ones drop). "Not reported" is proved by a marker: after
// the frame's verdict is counted, a RARP with a fresh MAC from a watched
// pod must be the next event.
func TestAnnouncementEvents(t *testing.T) {
	requireDatapath(t)
	h := newHost(t)
	p1 := h.addPod(t, 1)
	p2 := h.addPod(t, 2)
	d := openDatapath(t, pinDir(t))
	h.attach(t, d, p1.ep)
	h.attach(t, d, p2.ep)
	events := announcements(t, d)
	require.NoError(t, d.WatchAnnouncements(p1.ep.HostIfIndex))
	require.NoError(t, d.WatchAnnouncements(p1.ep.HostIfIndex), "idempotent")

	marker := func(t *testing.T, from *pod) {
		t.Helper()
		mac := randomMAC(t)
		before := counters(t, d, from.ep.ID)
		from.sendFrame(t, rarpFrame(mac))
		awaitVerdict(t, d, from, before, false)
		require.Equal(t, Announcement{HostIfIndex: from.ep.HostIfIndex, Kind: AnnounceRARP, MAC: mac},
			nextAnnouncement(t, events), "the marker is the next event: nothing else was reported")
	}
	garp := func(p *pod, op uint16, a netip.Addr) []byte { return arpOpFrame(broadcast, p.mac, op, a, a) }
	allNodes := net.HardwareAddr{0x33, 0x33, 0, 0, 0, 1}
	na := func(p *pod, target netip.Addr, flags byte) []byte {
		return naFrame(allNodes, p.mac, p.v6, target, nil, flags)
	}

	cases := []struct {
		name  string
		from  *pod
		frame []byte
		drop  bool
		want  *Announcement
	}{
		{name: "garp request", from: p1, frame: garp(p1, 1, p1.v4),
			want: &Announcement{HostIfIndex: p1.ep.HostIfIndex, Kind: AnnounceGARP, Addr: p1.v4, MAC: p1.mac}},
		{name: "garp reply", from: p1, frame: garp(p1, 2, p1.v4),
			want: &Announcement{HostIfIndex: p1.ep.HostIfIndex, Kind: AnnounceGARP, Addr: p1.v4, MAC: p1.mac}},
		{name: "unsolicited na", from: p1, frame: na(p1, p1.v6, naOverride),
			want: &Announcement{HostIfIndex: p1.ep.HostIfIndex, Kind: AnnounceNA, Addr: p1.v6, MAC: p1.mac}},
		{name: "unsolicited na behind dstopts", from: p1, frame: naFrame(allNodes, p1.mac, p1.v6, p1.v6, dstOpts(), 0),
			want: &Announcement{HostIfIndex: p1.ep.HostIfIndex, Kind: AnnounceNA, Addr: p1.v6, MAC: p1.mac}},
		{name: "rarp", from: p1, frame: rarpFrame(p1.mac),
			want: &Announcement{HostIfIndex: p1.ep.HostIfIndex, Kind: AnnounceRARP, MAC: p1.mac}},
		{name: "rarp reply", from: p1, frame: rarpOpFrame(p1.mac, 4),
			want: &Announcement{HostIfIndex: p1.ep.HostIfIndex, Kind: AnnounceRARP, MAC: p1.mac}},
		{name: "rarp frame of another operation", from: p1, frame: rarpOpFrame(p1.mac, 1)},
		{name: "arp not gratuitous", from: p1, frame: arpFrame(p1.hostMAC, p1.mac, p1.v4, gatewayV4)},
		{name: "arp probe", from: p1, frame: arpFrame(broadcast, p1.mac, netip.IPv4Unspecified(), p1.v4)},
		{name: "solicited na", from: p1, frame: na(p1, p1.v6, naSolicited|naOverride)},
		{name: "na link-local target", from: p1, frame: naFrame(allNodes, p1.mac, p1.linkLocal, p1.linkLocal, nil, naOverride)},
		{name: "garp neighbour's address", from: p1, frame: garp(p1, 1, p2.v4), drop: true},
		{name: "garp random address", from: p1, frame: garp(p1, 1, spoof4), drop: true},
		{name: "na neighbour's address", from: p1, frame: na(p1, p2.v6, naOverride), drop: true},
		{name: "garp on unwatched veth", from: p2, frame: garp(p2, 1, p2.v4)},
		{name: "na on unwatched veth", from: p2, frame: na(p2, p2.v6, 0)},
		{name: "rarp on unwatched veth", from: p2, frame: rarpFrame(p2.mac)},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			before := counters(t, d, c.from.ep.ID)
			c.from.sendFrame(t, c.frame)
			awaitVerdict(t, d, c.from, before, c.drop)
			if c.want != nil {
				require.Equal(t, *c.want, nextAnnouncement(t, events))
			}
			marker(t, p1)
		})
	}

	t.Run("unwatched", func(t *testing.T) {
		require.NoError(t, d.UnwatchAnnouncements(p1.ep.HostIfIndex))
		require.NoError(t, d.UnwatchAnnouncements(p1.ep.HostIfIndex), "unwatching what is not watched")
		before := counters(t, d, p1.ep.ID)
		p1.sendFrame(t, rarpFrame(p1.mac))
		awaitVerdict(t, d, p1, before, false)
		require.NoError(t, d.WatchAnnouncements(p2.ep.HostIfIndex))
		marker(t, p2)
	})
}

// TestAnnouncementWatchLifetime: a watch goes with its endpoint (Detach,
// and Adopt of an interface without one), so a later endpoint on the same
// ifindex is not watched; one reader at a time; the Datapath's Close ends a
// Read in progress with ErrClosed.
func TestAnnouncementWatchLifetime(t *testing.T) {
	requireDatapath(t)
	h := newHost(t)
	p := h.addPod(t, 1)
	dir := pinDir(t)
	d := openDatapath(t, dir)
	h.attach(t, d, p.ep)
	ifindex := uint32(p.ep.HostIfIndex)
	watched := func(d *Datapath) bool {
		var flags uint32
		err := d.objs.KvipamWatch.Lookup(ifindex, &flags)
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return false
		}
		require.NoError(t, err)
		return true
	}

	require.NoError(t, d.WatchAnnouncements(p.ep.HostIfIndex))
	require.True(t, watched(d))
	h.detach(t, d, p.ep)
	require.False(t, watched(d), "Detach removed the watch")

	// An ifindex watched without an endpoint (a crash between Detach's
	// steps, or a watch of what was never attached) is dropped by Adopt.
	require.NoError(t, d.WatchAnnouncements(p.ep.HostIfIndex))
	h.attach(t, d, p.ep)
	require.NoError(t, d.WatchAnnouncements(999))
	h.adopt(t, d)
	require.True(t, watched(d), "an adopted endpoint keeps its watch")
	var flags uint32
	require.ErrorIs(t, d.objs.KvipamWatch.Lookup(uint32(999), &flags), ebpf.ErrKeyNotExist, "Adopt dropped the stale watch")
	require.ErrorIs(t, d.WatchAnnouncements(0), ErrInvalidEndpoint)

	r, err := d.Announcements()
	require.NoError(t, err)
	_, err = d.Announcements()
	require.ErrorIs(t, err, ErrReaderOpen)
	require.NoError(t, r.Close())
	require.NoError(t, r.Close(), "closing twice")
	r, err = d.Announcements()
	require.NoError(t, err, "a new reader once the first is closed")

	readErr := make(chan error, 1)
	go func() {
		_, err := r.Read()
		readErr <- err
	}()
	require.NoError(t, d.Close())
	require.ErrorIs(t, <-readErr, ErrClosed)
	require.NoError(t, r.Close(), "closing a reader its Datapath closed")
	require.ErrorIs(t, d.WatchAnnouncements(p.ep.HostIfIndex), ErrClosed)
	_, err = d.Announcements()
	require.ErrorIs(t, err, ErrClosed)
}
