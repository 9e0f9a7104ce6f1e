package announce_test

import (
	"github.com/kvipam/kvipam/agent/announce"
	"github.com/kvipam/kvipam/bpf"
	"net/netip"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/internal/testsupport/guestannounce"
)

// TestAnnouncementReported: for each implementation and each kind, the
// guest's announcement on the watched host veth arrives on C with the
// host veth's index and name, the kind, the address (none for announce.RARP) and
// the sender's MAC (the interface's own when Send is given none).
func TestAnnouncementReported(t *testing.T) {
	for _, im := range impls {
		t.Run(im.name, func(t *testing.T) {
			e := newEnv(t, im)
			p := e.p1
			p.watch(t, e.w)
			guestMAC := randomMAC(t)
			cases := []struct {
				name string
				kind announce.Kind
				addr netip.Addr
				mac  []byte
				want announce.Announcement
			}{
				{name: "garp", kind: announce.GratuitousARP, addr: p.v4, want: announce.Announcement{Addr: p.v4, MAC: p.mac}},
				{name: "na", kind: announce.NeighborAdvert, addr: p.v6, want: announce.Announcement{Addr: p.v6, MAC: p.mac}},
				{name: "rarp", kind: announce.RARP, want: announce.Announcement{MAC: p.mac}},
				{name: "rarp with the guest's MAC", kind: announce.RARP, mac: guestMAC, want: announce.Announcement{MAC: guestMAC}},
				{name: "garp with the guest's MAC", kind: announce.GratuitousARP, addr: p.v4, mac: guestMAC, want: announce.Announcement{Addr: p.v4, MAC: guestMAC}},
			}
			for _, c := range cases {
				t.Run(c.name, func(t *testing.T) {
					// guestannounce.Send, as the e2e tests use it.
					require.NoError(t, guestannounce.Send(p.ns.Path(), "eth0", c.kind, c.addr, c.mac))
					want := c.want
					want.HostIfIndex, want.HostIfName, want.Kind = p.ifindex, p.hostIf, c.kind
					require.Equal(t, want, next(t, e.w))
				})
			}
			require.Zero(t, e.w.Dropped())
		})
	}
}

// TestAnnouncementNotReported: an ARP that is not gratuitous, an RFC 5227
// probe, a gratuitous ARP or NA for an address that is not watched, a
// solicited NA, a announce.RARP frame of another operation, and announcements on a
// veth that is not watched are not reported. Each is followed by a marker
// (marker) that must be the first thing received.
func TestAnnouncementNotReported(t *testing.T) {
	for _, im := range impls {
		t.Run(im.name, func(t *testing.T) {
			e := newEnv(t, im)
			p1, p2 := e.p1, e.p2
			p1.watch(t, e.w)
			garp := func(p *pod, a netip.Addr) []byte {
				return guestannounce.ARP(guestannounce.Broadcast, p.mac, 1, a, a)
			}
			na := func(p *pod, target netip.Addr, flags byte) []byte {
				return guestannounce.NeighborAdvert(p.mac, target, target, flags)
			}
			rarpOp := func(p *pod, op uint16) []byte {
				f := guestannounce.RARPRequest(p.mac)
				f[14+7] = byte(op)
				return f
			}
			cases := []struct {
				name  string
				from  *pod
				frame []byte
			}{
				{"arp request, not gratuitous", p1, guestannounce.ARP(guestannounce.Broadcast, p1.mac, 1, p1.v4, p1.other4)},
				{"arp reply, not gratuitous", p1, guestannounce.ARP(p1.mac, p1.mac, 2, p1.v4, p1.other4)},
				{"arp probe", p1, guestannounce.ARP(guestannounce.Broadcast, p1.mac, 1, netip.IPv4Unspecified(), p1.v4)},
				{"garp for an address not watched", p1, garp(p1, p1.other4)},
				{"na for an address not watched", p1, na(p1, p1.other6, guestannounce.NAOverride)},
				{"solicited na", p1, na(p1, p1.v6, guestannounce.NASolicited|guestannounce.NAOverride)},
				{"rarp frame of another operation", p1, rarpOp(p1, 1)},
				{"garp on an unwatched veth", p2, garp(p2, p2.v4)},
				{"na on an unwatched veth", p2, na(p2, p2.v6, 0)},
				{"rarp on an unwatched veth", p2, guestannounce.RARPRequest(p2.mac)},
			}
			for _, c := range cases {
				t.Run(c.name, func(t *testing.T) {
					c.from.sendFrame(t, c.frame)
					marker(t, e.w, p1)
				})
			}
		})
	}
}

// TestWatchReplacesAddrs: a second Watch replaces the addresses: an
// announcement of the old one is no longer reported, of the new one is.
func TestWatchReplacesAddrs(t *testing.T) {
	for _, im := range impls {
		t.Run(im.name, func(t *testing.T) {
			e := newEnv(t, im)
			p := e.p1
			p.watch(t, e.w)
			require.NoError(t, e.w.Watch(p.hostIf, p.ifindex, []netip.Addr{p.other4}))
			p.send(t, announce.GratuitousARP, p.v4, nil)
			marker(t, e.w, p)
			p.send(t, announce.GratuitousARP, p.other4, nil)
			require.Equal(t, announce.Announcement{HostIfIndex: p.ifindex, HostIfName: p.hostIf, Kind: announce.GratuitousARP, Addr: p.other4, MAC: p.mac},
				next(t, e.w))
		})
	}
}

// TestUnwatchStopsReports: after Unwatch nothing of that veth is reported
// (a second watched veth's marker comes first); unwatching again, or what
// was never watched, succeeds; watching again reports again.
func TestUnwatchStopsReports(t *testing.T) {
	for _, im := range impls {
		t.Run(im.name, func(t *testing.T) {
			e := newEnv(t, im)
			p1, p2 := e.p1, e.p2
			p1.watch(t, e.w)
			p2.watch(t, e.w)
			require.NoError(t, e.w.Unwatch(p1.ifindex))
			require.NoError(t, e.w.Unwatch(p1.ifindex))
			require.NoError(t, e.w.Unwatch(12345))
			p1.send(t, announce.RARP, netip.Addr{}, nil)
			p1.send(t, announce.GratuitousARP, p1.v4, nil)
			marker(t, e.w, p2)
			p1.watch(t, e.w)
			p1.send(t, announce.NeighborAdvert, p1.v6, nil)
			require.Equal(t, announce.Announcement{HostIfIndex: p1.ifindex, HostIfName: p1.hostIf, Kind: announce.NeighborAdvert, Addr: p1.v6, MAC: p1.mac},
				next(t, e.w))
		})
	}
}

// TestCloseEnds: Close closes C, is idempotent, and Watch and Unwatch
// after it fail with announce.ErrClosed; the package's leak check proves the
// goroutines ended.
func TestCloseEnds(t *testing.T) {
	for _, im := range impls {
		t.Run(im.name, func(t *testing.T) {
			e := newEnv(t, im)
			e.p1.watch(t, e.w)
			e.p2.watch(t, e.w)
			require.NoError(t, e.w.Close())
			_, ok := <-e.w.C()
			require.False(t, ok, "C closed")
			require.NoError(t, e.w.Close())
			require.ErrorIs(t, e.w.Watch(e.p1.hostIf, e.p1.ifindex, nil), announce.ErrClosed)
			require.ErrorIs(t, e.w.Unwatch(e.p1.ifindex), announce.ErrClosed)
		})
	}
}

// TestWatchRejects: an index that is not positive, a name that does not
// match the index (packet watcher: a stale index would watch another
// pod's veth), and an address that cannot be a guest's are refused.
func TestWatchRejects(t *testing.T) {
	for _, im := range impls {
		t.Run(im.name, func(t *testing.T) {
			e := newEnv(t, im)
			p := e.p1
			require.ErrorIs(t, e.w.Watch(p.hostIf, 0, nil), announce.ErrInvalidWatch)
			require.ErrorIs(t, e.w.Watch("", p.ifindex, nil), announce.ErrInvalidWatch)
			require.ErrorIs(t, e.w.Watch(p.hostIf, p.ifindex, []netip.Addr{{}}), announce.ErrInvalidWatch)
			require.ErrorIs(t, e.w.Watch(p.hostIf, p.ifindex, []netip.Addr{netip.MustParseAddr("ff02::1")}), announce.ErrInvalidWatch)
			if im.name == "packet" {
				require.ErrorIs(t, e.w.Watch(p.hostIf, e.p2.ifindex, nil), announce.ErrInvalidWatch)
			}
		})
	}
}

// TestBPFWatcherDatapathClosedFirst: the datapath closed under a BPFWatcher
// ends its reading; the watcher's Close then still succeeds and closes C.
func TestBPFWatcherDatapathClosedFirst(t *testing.T) {
	requireDatapath(t)
	dp, err := bpf.Open(pinDir(t), testLog(t))
	require.NoError(t, err)
	w, err := announce.NewBPFWatcher(dp, testLog(t))
	require.NoError(t, err)
	_, err = announce.NewBPFWatcher(dp, testLog(t))
	require.ErrorIs(t, err, bpf.ErrReaderOpen, "one watcher per datapath")
	require.NoError(t, dp.Close())
	require.NoError(t, w.Close())
	_, ok := <-w.C()
	require.False(t, ok, "C closed")
}
