//go:build linux

package bpf

import (
	"errors"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"
)

var (
	spoof4 = netip.MustParseAddr("192.0.2.77")
	spoof6 = netip.MustParseAddr("2001:db8::77")
)

// Waits for a datagram that should arrive, and for one that should not.
const (
	arriveWait = 2 * time.Second
	absentWait = 300 * time.Millisecond
)

func recvAddr(from netip.Addr) netip.Addr {
	if from.Is4() {
		return recvV4
	}
	return recvV6
}

// hasNeighbor reports whether the host has a neighbour entry for a on p's
// host veth, that is whether an ARP message claiming a reached its stack.
func (h *host) hasNeighbor(tb testing.TB, p *pod, a netip.Addr) bool {
	tb.Helper()
	neighs, err := h.h.NeighList(p.ep.HostIfIndex, netlink.FAMILY_V4)
	require.NoError(tb, err)
	for _, n := range neighs {
		if ip, ok := netip.AddrFromSlice(n.IP); ok && ip.Unmap() == a {
			return true
		}
	}
	return false
}

func counters(tb testing.TB, d *Datapath, id uint32) Counters {
	tb.Helper()
	stats, err := d.Stats()
	require.NoError(tb, err)
	return stats[id]
}

// TestEnforcement sends every kind of frame the program judges from a pod and
// checks the verdict three ways: the host socket, the counters, and for ARP
// the host's neighbour table. A control run without the program shows the
// same forged frames do reach the host, so the drops are the program's.
func TestEnforcement(t *testing.T) {
	requireDatapath(t)
	h := newHost(t)
	p1 := h.addPod(t, 1)
	p2 := h.addPod(t, 2) // a neighbour whose addresses p1 tries to steal
	d := openDatapath(t, pinDir(t))

	t.Run("control without program", func(t *testing.T) {
		for _, from := range []netip.Addr{spoof4, spoof6} {
			payload := token(t, "control")
			p1.sendFrame(t, udpFrame(p1.hostMAC, p1.mac, from, recvAddr(from), recvPort, payload))
			src, ok := h.receiver(from).got(payload, arriveWait)
			require.True(t, ok, "forged frame from %s must arrive when no program runs", from)
			require.Equal(t, from, src)
		}
		stolen := netip.MustParseAddr("10.244.0.99")
		p1.sendFrame(t, arpFrame(p1.hostMAC, p1.mac, stolen, gatewayV4))
		require.Eventually(t, func() bool { return h.hasNeighbor(t, p1, stolen) }, arriveWait, 10*time.Millisecond,
			"forged ARP must poison the host's neighbour table when no program runs")
	})

	h.attach(t, d, p1.ep)
	h.attach(t, d, p2.ep)

	udpFrom := func(from netip.Addr) func(testing.TB, string) int {
		return func(tb testing.TB, payload string) int {
			f := udpFrame(p1.hostMAC, p1.mac, from, recvAddr(from), recvPort, payload)
			p1.sendFrame(tb, f)
			return len(f)
		}
	}
	udpStack := func(to netip.Addr) func(testing.TB, string) int {
		return func(tb testing.TB, payload string) int {
			p1.sendUDP(tb, to, payload)
			return 0
		}
	}
	udpDstOptsFrom := func(from netip.Addr) func(testing.TB, string) int {
		return func(tb testing.TB, payload string) int {
			f := udpDstOpts(p1, from, recvAddr(from), payload)
			p1.sendFrame(tb, f)
			return len(f)
		}
	}
	frame := func(f []byte) func(testing.TB, string) int {
		return func(tb testing.TB, _ string) int {
			p1.sendFrame(tb, f)
			return len(f)
		}
	}
	zero4 := netip.IPv4Unspecified()
	otherLL := netip.MustParseAddr("fe80::dead")

	cases := []struct {
		name string
		// send sends one frame (several for the stack) and returns its
		// length, or 0 when the pod's stack built it.
		send func(tb testing.TB, payload string) int
		// to is where a UDP datagram goes, checked on the host's socket.
		to   netip.Addr
		drop bool
		// after checks the host's state once the verdict is counted.
		after func(t *testing.T)
	}{
		{name: "ipv4 own source via pod stack", send: udpStack(recvV4), to: recvV4},
		{name: "ipv6 own source via pod stack", send: udpStack(recvV6), to: recvV6},
		{name: "ipv4 own source forged frame", send: udpFrom(p1.v4), to: recvV4},
		{name: "ipv4 random source", send: udpFrom(spoof4), to: recvV4, drop: true},
		{name: "ipv4 neighbour pod's source", send: udpFrom(p2.v4), to: recvV4, drop: true},
		{name: "ipv4 unspecified source", send: udpFrom(zero4), to: recvV4, drop: true},
		{name: "ipv6 own source forged frame", send: udpFrom(p1.v6), to: recvV6},
		{name: "ipv6 link-local source", send: udpFrom(otherLL), to: recvV6},
		{name: "ipv6 own source behind dstopts", send: udpDstOptsFrom(p1.v6), to: recvV6},
		{name: "ipv6 random source", send: udpFrom(spoof6), to: recvV6, drop: true},
		{name: "ipv6 unspecified source outside icmpv6", send: udpFrom(netip.IPv6Unspecified()), to: recvV6, drop: true},
		{name: "ipv6 neighbour pod's source", send: udpFrom(p2.v6), to: recvV6, drop: true},
		{name: "arp own sender", send: frame(arpFrame(p1.hostMAC, p1.mac, p1.v4, gatewayV4))},
		{name: "arp probe from 0.0.0.0", send: frame(arpFrame(p1.hostMAC, p1.mac, zero4, gatewayV4))},
		{
			name: "arp neighbour pod's sender", drop: true,
			send: frame(arpFrame(p1.hostMAC, p1.mac, p2.v4, gatewayV4)),
			after: func(t *testing.T) {
				require.False(t, h.hasNeighbor(t, p1, p2.v4), "host learnt a neighbour from a dropped ARP")
			},
		},
		{name: "arp random sender", send: frame(arpFrame(p1.hostMAC, p1.mac, spoof4, gatewayV4)), drop: true},
		{name: "na own target", send: frame(neighborAdvert(p1.hostMAC, p1.mac, p1.linkLocal, p1.v6, nil))},
		{name: "na link-local target", send: frame(neighborAdvert(p1.hostMAC, p1.mac, p1.linkLocal, p1.linkLocal, nil))},
		{name: "na own target behind dstopts", send: frame(neighborAdvert(p1.hostMAC, p1.mac, p1.linkLocal, p1.v6, dstOpts()))},
		{name: "na neighbour pod's target", send: frame(neighborAdvert(p1.hostMAC, p1.mac, p1.linkLocal, p2.v6, nil)), drop: true},
		{name: "na random target from own address", send: frame(neighborAdvert(p1.hostMAC, p1.mac, p1.v6, spoof6, nil)), drop: true},
		{name: "na random target behind dstopts", send: frame(neighborAdvert(p1.hostMAC, p1.mac, p1.linkLocal, spoof6, dstOpts())), drop: true},
		{name: "ns dad from unspecified", send: frame(neighborSolicit(p1.hostMAC, p1.mac, p1.v6))},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			before := counters(t, d, p1.ep.ID)
			neighbour := counters(t, d, p2.ep.ID)
			payload := token(t, "udp")
			n := c.send(t, payload)
			if c.to.IsValid() {
				wait := arriveWait
				if c.drop {
					wait = absentWait
				}
				_, ok := h.receiver(c.to).got(payload, wait)
				require.Equal(t, !c.drop, ok, "datagram arrived")
			}
			var now Counters
			require.Eventually(t, func() bool {
				now = counters(t, d, p1.ep.ID)
				if c.drop {
					return now.DroppedPackets > before.DroppedPackets
				}
				return now.PassedPackets > before.PassedPackets
			}, arriveWait, 5*time.Millisecond, "verdict counted")
			if c.drop {
				require.Equal(t, before.DroppedPackets+1, now.DroppedPackets)
				require.Equal(t, before.DroppedBytes+uint64(n), now.DroppedBytes)
			} else {
				require.Equal(t, before.DroppedPackets, now.DroppedPackets, "nothing dropped")
				if n > 0 {
					require.GreaterOrEqual(t, now.PassedBytes, before.PassedBytes+uint64(n))
				}
			}
			require.Equal(t, neighbour.DroppedPackets, counters(t, d, p2.ep.ID).DroppedPackets,
				"p1's frames are not counted against p2")
			if c.after != nil {
				c.after(t)
			}
		})
	}
}

// TestCloseKeepsEnforcingThenAdopt plays an agent that dies and restarts: the
// program keeps dropping forged frames while no process holds it, and the new
// process adopts the endpoint without detaching it (the kernel's attachment
// revision, link ID and program ID are unchanged) and sees the counts made
// while it was away.
func TestCloseKeepsEnforcingThenAdopt(t *testing.T) {
	requireDatapath(t)
	h := newHost(t)
	p := h.addPod(t, 1)
	dir := pinDir(t)
	d := openDatapath(t, dir)
	h.attach(t, d, p.ep)

	before := h.tcx(t, p.ep.HostIfIndex)
	linkID := pinnedLinkID(t, dir, p.ep.HostIfIndex)
	require.Equal(t, []link.ID{linkID}, before.links)
	countsBefore := counters(t, d, p.ep.ID)
	require.NoError(t, d.Close())
	_, err := d.Stats()
	require.ErrorIs(t, err, ErrClosed)

	// No agent: forged frames are still dropped, own ones still pass.
	forged := token(t, "forged")
	p.sendFrame(t, udpFrame(p.hostMAC, p.mac, spoof4, recvV4, recvPort, forged))
	_, ok := h.recv4.got(forged, absentWait)
	require.False(t, ok, "forged frame arrived while the agent was down")
	own := token(t, "own")
	p.sendFrame(t, udpFrame(p.hostMAC, p.mac, p.v4, recvV4, recvPort, own))
	_, ok = h.recv4.got(own, arriveWait)
	require.True(t, ok)

	d2 := openDatapath(t, dir)
	eps := h.adopt(t, d2)
	want, err := p.ep.normalize()
	require.NoError(t, err)
	require.Equal(t, []Endpoint{want}, eps)
	require.Equal(t, before, h.tcx(t, p.ep.HostIfIndex), "attachment changed: revision, programs or links")
	require.Equal(t, linkID, pinnedLinkID(t, dir, p.ep.HostIfIndex))

	countsAfter := counters(t, d2, p.ep.ID)
	require.Equal(t, countsBefore.DroppedPackets+1, countsAfter.DroppedPackets, "drop while down was counted")
	require.Greater(t, countsAfter.PassedPackets, countsBefore.PassedPackets)

	// The new process drives the adopted endpoint as if it had attached it.
	h.detach(t, d2, p.ep)
	require.Empty(t, h.tcx(t, p.ep.HostIfIndex).programs)
	require.False(t, linkExists(linkID))
	requireNoEntries(t, dir, p.ep)
}

// TestAdoptRepairs leaves behind what a crash in the middle of Attach or
// Detach, or a pod deleted while the agent was down, would, and checks that
// Adopt converges: a live endpoint ends up attached and counted in the
// result, a dead one leaves no link, pin or map entry.
func TestAdoptRepairs(t *testing.T) {
	requireDatapath(t)
	cases := []struct {
		name   string
		damage func(t *testing.T, h *host, p *pod, dir string, d *Datapath)
		alive  bool
	}{
		{
			name: "interface deleted while agent down",
			damage: func(t *testing.T, h *host, p *pod, _ string, _ *Datapath) {
				require.NoError(t, h.h.LinkDel(p.hostIf))
			},
		},
		{
			name:  "crash between map writes and attach",
			alive: true,
			damage: func(t *testing.T, h *host, p *pod, dir string, d *Datapath) {
				inNS(t, h.ns, func() error {
					_, err := d.detachTCX(p.ep.HostIfIndex)
					return err
				})
			},
		},
		{
			name: "crash between map removal and detach",
			damage: func(t *testing.T, h *host, p *pod, dir string, d *Datapath) {
				require.NoError(t, d.removeEndpoint(uint32(p.ep.HostIfIndex), p.ep.ID))
			},
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h := newHost(t)
			p := h.addPod(t, 1)
			dir := pinDir(t)
			d := openDatapath(t, dir)
			h.attach(t, d, p.ep)
			linkID := pinnedLinkID(t, dir, p.ep.HostIfIndex)
			c.damage(t, h, p, dir, d)
			require.NoError(t, d.Close())

			d2 := openDatapath(t, dir)
			eps := h.adopt(t, d2)
			if !c.alive {
				require.Empty(t, eps)
				require.False(t, linkExists(linkID))
				require.NoFileExists(t, d2.linkPin(p.ep.HostIfIndex))
				requireNoEntries(t, dir, p.ep)
				return
			}
			want, _ := p.ep.normalize()
			require.Equal(t, []Endpoint{want}, eps)
			requireEntries(t, dir, want)
			require.Len(t, h.tcx(t, p.ep.HostIfIndex).links, 1)
			forged := token(t, "forged")
			p.sendFrame(t, udpFrame(p.hostMAC, p.mac, spoof6, recvV6, recvPort, forged))
			_, ok := h.recv6.got(forged, absentWait)
			require.False(t, ok)
		})
	}
}

// TestDetachLeavesNothing checks Detach against the kernel's own listings:
// no link (by ID), nothing attached to the interface's TCX ingress, no clsact
// qdisc or filter, no pin, no map entry; the other endpoint is untouched, a
// second Detach is a no-op, and once everything is detached and the
// Datapath closed the program itself is gone from the kernel.
func TestDetachLeavesNothing(t *testing.T) {
	requireDatapath(t)
	h := newHost(t)
	p1 := h.addPod(t, 1)
	p2 := h.addPod(t, 2)
	dir := pinDir(t)
	d := openDatapath(t, dir)
	h.attach(t, d, p1.ep)
	h.attach(t, d, p2.ep)
	link1 := pinnedLinkID(t, dir, p1.ep.HostIfIndex)
	prog := h.tcx(t, p1.ep.HostIfIndex).programs[0]

	h.detach(t, d, p1.ep)
	require.False(t, linkExists(link1), "link %d still exists", link1)
	require.Equal(t, []uint32{uint32(p2.ep.HostIfIndex)}, tcxLinksOf(t, prog),
		"the kernel's link list still has a link running our program on p1's veth")
	require.Empty(t, h.tcx(t, p1.ep.HostIfIndex).programs)
	require.Equal(t, tcState{}, h.tc(t, p1.ep.HostIfIndex), "clsact qdisc or filter left")
	require.NoFileExists(t, d.linkPin(p1.ep.HostIfIndex))
	requireNoEntries(t, dir, p1.ep)
	stats, err := d.Stats()
	require.NoError(t, err)
	require.NotContains(t, stats, p1.ep.ID)

	// p1 is unfiltered now; p2 is still enforced.
	payload := token(t, "unfiltered")
	p1.sendFrame(t, udpFrame(p1.hostMAC, p1.mac, spoof4, recvV4, recvPort, payload))
	_, ok := h.recv4.got(payload, arriveWait)
	require.True(t, ok)
	requireEntries(t, dir, p2.ep)
	require.Len(t, h.tcx(t, p2.ep.HostIfIndex).links, 1)

	h.detach(t, d, p1.ep) // idempotent
	h.detach(t, d, p2.ep)
	require.NoError(t, d.Close())
	require.Eventually(t, func() bool {
		p, err := ebpf.NewProgramFromID(prog)
		if err == nil {
			_ = p.Close()
		}
		return errors.Is(err, os.ErrNotExist)
	}, 5*time.Second, 20*time.Millisecond, "program %d still loaded", prog)
	s := readPinned(t, dir)
	require.Empty(t, s.addrs)
	require.Empty(t, s.ifaces)
	require.Equal(t, map[uint32]bool{0: true}, s.counters)
}

// tcxLinksOf walks the kernel's list of all links and returns the ifindexes
// of the TCX links running prog.
func tcxLinksOf(tb testing.TB, prog ebpf.ProgramID) []uint32 {
	tb.Helper()
	var ifindexes []uint32
	it := new(link.Iterator)
	defer it.Close()
	for it.Next() {
		info, err := it.Link.Info()
		if err != nil || info.Program != prog {
			continue
		}
		if tcx := info.TCX(); tcx != nil {
			ifindexes = append(ifindexes, tcx.Ifindex)
		}
	}
	require.NoError(tb, it.Err())
	return ifindexes
}

// TestDetachGoneInterface detaches an endpoint whose veth was deleted first,
// as when the pod's netns went away before CNI DEL.
func TestDetachGoneInterface(t *testing.T) {
	requireDatapath(t)
	h := newHost(t)
	p := h.addPod(t, 1)
	dir := pinDir(t)
	d := openDatapath(t, dir)
	h.attach(t, d, p.ep)
	linkID := pinnedLinkID(t, dir, p.ep.HostIfIndex)
	require.NoError(t, h.h.LinkDel(p.hostIf))

	h.detach(t, d, p.ep)
	h.detach(t, d, p.ep)
	require.False(t, linkExists(linkID))
	require.NoFileExists(t, d.linkPin(p.ep.HostIfIndex))
	requireNoEntries(t, dir, p.ep)
}

// TestAttachIdempotent attaches the same endpoint again (same link, same
// kernel revision: no detach, no duplicate) and then with different
// addresses (the dropped one is no longer allowed).
func TestAttachIdempotent(t *testing.T) {
	requireDatapath(t)
	h := newHost(t)
	p := h.addPod(t, 1)
	dir := pinDir(t)
	d := openDatapath(t, dir)
	h.attach(t, d, p.ep)
	first := h.tcx(t, p.ep.HostIfIndex)
	require.Len(t, first.links, 1)

	h.attach(t, d, p.ep)
	require.Equal(t, first, h.tcx(t, p.ep.HostIfIndex))

	extra := netip.MustParseAddr("10.244.0.50")
	changed := p.ep
	changed.IPs = []netip.Addr{p.v4, extra}
	h.attach(t, d, changed)
	require.Equal(t, first, h.tcx(t, p.ep.HostIfIndex))
	requireEntries(t, dir, changed)

	payload := token(t, "old-v6")
	p.sendFrame(t, udpFrame(p.hostMAC, p.mac, p.v6, recvV6, recvPort, payload))
	_, ok := h.recv6.got(payload, absentWait)
	require.False(t, ok, "address removed from the endpoint still passes")
	payload = token(t, "new-v4")
	p.sendFrame(t, udpFrame(p.hostMAC, p.mac, extra, recvV4, recvPort, payload))
	_, ok = h.recv4.got(payload, arriveWait)
	require.True(t, ok, "address added to the endpoint is dropped")
}

// TestAttachRejects covers endpoints Attach must refuse, and checks that a
// refused or failed Attach leaves the maps as they were.
func TestAttachRejects(t *testing.T) {
	requireDatapath(t)
	h := newHost(t)
	p1 := h.addPod(t, 1)
	p2 := h.addPod(t, 2)
	dir := pinDir(t)
	d := openDatapath(t, dir)
	h.attach(t, d, p1.ep)
	snapshot := readPinned(t, dir)

	with := func(change func(*Endpoint)) Endpoint {
		ep := p2.ep
		ep.IPs = append([]netip.Addr(nil), p2.ep.IPs...)
		change(&ep)
		return ep
	}
	cases := []struct {
		name string
		ep   Endpoint
		err  error // nil: any error
	}{
		{"id 0", with(func(e *Endpoint) { e.ID = 0 }), ErrInvalidEndpoint},
		{"no ifindex", with(func(e *Endpoint) { e.HostIfIndex = 0 }), ErrInvalidEndpoint},
		{"no addresses", with(func(e *Endpoint) { e.IPs = nil }), ErrInvalidEndpoint},
		{"multicast address", with(func(e *Endpoint) { e.IPs = []netip.Addr{netip.MustParseAddr("224.0.0.1")} }), ErrInvalidEndpoint},
		{"unspecified address", with(func(e *Endpoint) { e.IPs = []netip.Addr{netip.IPv6Unspecified()} }), ErrInvalidEndpoint},
		{"short MAC", with(func(e *Endpoint) { e.MAC = net.HardwareAddr{1, 2, 3} }), ErrInvalidEndpoint},
		{"long ifname", with(func(e *Endpoint) { e.HostIfName = "a-very-long-interface-name" }), ErrInvalidEndpoint},
		{"address of another endpoint", with(func(e *Endpoint) { e.IPs = append(e.IPs, p1.v4) }), ErrAddressInUse},
		{"interface does not exist", with(func(e *Endpoint) { e.HostIfIndex = 99999 }), nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var err error
			inNS(t, h.ns, func() error {
				err = d.Attach(c.ep)
				return nil
			})
			require.Error(t, err)
			if c.err != nil {
				require.ErrorIs(t, err, c.err)
			}
			require.Equal(t, snapshot, readPinned(t, dir), "maps changed by a failed attach")
			requireOwnersMatch(t, d)
		})
	}
}

// TestClsactFallback runs the datapath as on a kernel without TCX: a clsact
// filter enforces, survives Close, is adopted in place, and Detach removes
// the filter and the qdisc it added.
func TestClsactFallback(t *testing.T) {
	requireDatapath(t)
	h := newHost(t)
	p := h.addPod(t, 1)
	dir := pinDir(t)
	d := openDatapath(t, dir)
	d.noTCX.Store(true) // as on a kernel without TCX
	h.attach(t, d, p.ep)
	require.Empty(t, h.tcx(t, p.ep.HostIfIndex).programs)
	st := h.tc(t, p.ep.HostIfIndex)
	require.True(t, st.clsact)
	require.Equal(t, 1, st.filters)
	require.NotZero(t, st.filterProg)

	forged := token(t, "forged")
	p.sendFrame(t, udpFrame(p.hostMAC, p.mac, spoof4, recvV4, recvPort, forged))
	_, ok := h.recv4.got(forged, absentWait)
	require.False(t, ok)
	h.attach(t, d, p.ep)
	require.Equal(t, st, h.tc(t, p.ep.HostIfIndex), "second attach changed the filter")
	require.NoError(t, d.Close())

	d2 := openDatapath(t, dir)
	want, _ := p.ep.normalize()
	require.Equal(t, []Endpoint{want}, h.adopt(t, d2))
	require.Equal(t, st, h.tc(t, p.ep.HostIfIndex), "adopt changed the filter")
	require.Empty(t, h.tcx(t, p.ep.HostIfIndex).programs, "adopt added a tcx link")
	require.Equal(t, uint64(1), counters(t, d2, p.ep.ID).DroppedPackets)

	h.detach(t, d2, p.ep)
	require.Equal(t, tcState{}, h.tc(t, p.ep.HostIfIndex))
	requireNoEntries(t, dir, p.ep)
}

// TestSupportedMatchesAttach checks Supported's promise: when it says yes,
// a real Open and Attach work.
func TestSupportedMatchesAttach(t *testing.T) {
	requireRoot(t)
	if err := Supported(); err != nil {
		t.Skipf("Supported says no (%v); nothing to compare", err)
	}
	h := newHost(t)
	p := h.addPod(t, 1)
	d := openDatapath(t, pinDir(t))
	h.attach(t, d, p.ep)
}

// TestOpenRejects checks that Open refuses a pin directory off bpffs and
// pinned maps of another layout (an upgrade that changed a map must not
// silently start from an empty one).
func TestOpenRejects(t *testing.T) {
	requireDatapath(t)
	t.Run("not bpffs", func(t *testing.T) {
		_, err := Open(t.TempDir(), nil)
		require.ErrorContains(t, err, "not on bpffs")
	})
	t.Run("incompatible pinned map", func(t *testing.T) {
		dir := pinDir(t)
		require.NoError(t, os.MkdirAll(dir, 0o700))
		m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Hash, KeySize: 4, ValueSize: 4, MaxEntries: 1})
		require.NoError(t, err)
		defer m.Close()
		require.NoError(t, m.Pin(filepath.Join(dir, "kvipam_addrs")))
		_, err = Open(dir, nil)
		require.ErrorIs(t, err, ebpf.ErrMapIncompatible)
	})
}
