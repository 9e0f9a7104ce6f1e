package bgp

import (
	"context"
	"net"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	api "github.com/osrg/gobgp/v3/api"
	"github.com/osrg/gobgp/v3/pkg/server"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/anypb"
)

// router is a plain GoBGP server on loopback (AS 65000) that the speaker
// under test peers with.
func router(t *testing.T) (*server.BgpServer, uint32) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := ln.Addr().(*net.TCPAddr).Port
	require.NoError(t, ln.Close())
	r := server.NewBgpServer(server.LoggerOption(logAdapter{l: hclog.NewNullLogger()}))
	go r.Serve()
	ctx := context.Background()
	require.NoError(t, r.StartBgp(ctx, &api.StartBgpRequest{Global: &api.Global{Asn: 65000, RouterId: "127.0.0.2",
		ListenPort: int32(port), ListenAddresses: []string{"127.0.0.1"}}}))
	afi := func(f *api.Family) *api.AfiSafi {
		return &api.AfiSafi{Config: &api.AfiSafiConfig{Family: f, Enabled: true}}
	}
	require.NoError(t, r.AddPeer(ctx, &api.AddPeerRequest{Peer: &api.Peer{
		Conf:      &api.PeerConf{NeighborAddress: "127.0.0.1", PeerAsn: 65001},
		Transport: &api.Transport{PassiveMode: true},
		AfiSafis:  []*api.AfiSafi{afi(familyV4), afi(familyV6)},
	}}))
	t.Cleanup(func() {
		// The speaker under test stops first (cleanups run last in, first
		// out). Await the router's side of the session going down before
		// StopBgp: GoBGP's StopBgp writes a neighbor's configuration while
		// an established session's receive loop reads it (a data race in
		// GoBGP v3.37 that the race detector caught in CI under load).
		for i := 0; i < 3000 && established(r); i++ {
			time.Sleep(10 * time.Millisecond)
		}
		_ = r.StopBgp(context.Background(), &api.StopBgpRequest{})
		r.Stop()
	})
	return r, uint32(port)
}

// established reports whether a session of the router is established.
func established(r *server.BgpServer) bool {
	up := false
	_ = r.ListPeer(context.Background(), &api.ListPeerRequest{}, func(p *api.Peer) {
		up = up || p.GetState().GetSessionState() == api.PeerState_ESTABLISHED
	})
	return up
}

// received are the prefixes the router has, with their next hops.
func received(t *testing.T, r *server.BgpServer) map[netip.Prefix]string {
	t.Helper()
	out := map[netip.Prefix]string{}
	for _, f := range []*api.Family{familyV4, familyV6} {
		require.NoError(t, r.ListPath(context.Background(), &api.ListPathRequest{TableType: api.TableType_GLOBAL, Family: f}, func(d *api.Destination) {
			for _, p := range d.Paths {
				nh := ""
				for _, a := range p.Pattrs {
					var n api.NextHopAttribute
					var mp api.MpReachNLRIAttribute
					switch {
					case a.UnmarshalTo(&n) == nil:
						nh = n.NextHop
					case a.UnmarshalTo(&mp) == nil && len(mp.NextHops) > 0:
						nh = mp.NextHops[0]
					}
				}
				out[netip.MustParsePrefix(d.Prefix)] = nh
			}
		}))
	}
	return out
}

// TestBGPSpeakerAnnouncesAndWithdraws: a speaker peers with a GoBGP router
// on loopback only after its first Sync, announces that set (IPv4 with a
// NEXT_HOP, IPv6 in MP_REACH_NLRI, each with the node's address of the
// family), withdraws what a later Sync leaves out and announces what it
// adds; Status and the metrics show the established peer and the counts.
func TestBGPSpeakerAnnouncesAndWithdraws(t *testing.T) {
	r, port := router(t)
	cfg := Config{ASN: 65001, RestartTime: Duration{7 * time.Second}, Peers: []Peer{{Address: "127.0.0.1", ASN: 65000, Port: port, HoldTime: Duration{9 * time.Second}}}}
	ctx := context.Background()
	s, err := Start(ctx, cfg, Options{Node: "n1", RouterID: netip.MustParseAddr("127.0.0.1"), Logger: hclog.NewNullLogger()})
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Stop(context.Background()) })
	require.Empty(t, s.Status(ctx).Peers, "no peer before the first Sync")

	nh4, nh6 := netip.MustParseAddr("10.254.1.11"), netip.MustParseAddr("fd00:254:1::11")
	block4, block6 := netip.MustParsePrefix("10.9.0.0/27"), netip.MustParsePrefix("fd00:9::/120")
	borrowed := netip.MustParsePrefix("10.9.0.70/32")
	require.NoError(t, s.Sync(ctx, []Route{{block4, nh4}, {block6, nh6}, {borrowed, nh4}}))
	require.Eventually(t, func() bool {
		got := received(t, r)
		return got[block4] == nh4.String() && got[block6] == nh6.String() && got[borrowed] == nh4.String() && len(got) == 3
	}, 30*time.Second, 50*time.Millisecond, "the router has the three prefixes with the node's next hops")
	st := s.Status(ctx)
	require.Len(t, st.Peers, 1)
	require.Equal(t, "established", st.Peers[0].State)
	require.Equal(t, map[string]int{"ipv4": 2, "ipv6": 1}, st.Announced)
	require.Equal(t, map[string]uint64{"ipv4": 2, "ipv6": 1}, st.Peers[0].Advertised,
		"what was sent: this router has no graceful restart, so no End-of-RIB is counted away")
	require.Empty(t, st.Peers[0].Reason)

	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(s.Collector())
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP kvipam_bgp_peer_up 1 while the BGP session with the peer is established, else 0.
# TYPE kvipam_bgp_peer_up gauge
kvipam_bgp_peer_up{peer="127.0.0.1",peer_asn="65000"} 1
# HELP kvipam_bgp_announced_prefixes Prefixes this node announces (its blocks and borrowed addresses), per family.
# TYPE kvipam_bgp_announced_prefixes gauge
kvipam_bgp_announced_prefixes{family="ipv4"} 2
kvipam_bgp_announced_prefixes{family="ipv6"} 1
`), "kvipam_bgp_peer_up", "kvipam_bgp_announced_prefixes"))

	// The borrowed address is given back, another block claimed.
	block4b := netip.MustParsePrefix("10.9.0.32/27")
	require.NoError(t, s.Sync(ctx, []Route{{block4, nh4}, {block6, nh6}, {block4b, nh4}}))
	require.Eventually(t, func() bool {
		got := received(t, r)
		_, still := got[borrowed]
		return !still && got[block4b] == nh4.String() && len(got) == 3
	}, 30*time.Second, 50*time.Millisecond, "withdrawn and announced")

	// A route the router sends is received but not kept: the node
	// installs none.
	learned := netip.MustParsePrefix("192.0.2.0/24")
	nlri, _ := anypb.New(&api.IPAddressPrefix{Prefix: "192.0.2.0", PrefixLen: 24})
	origin, _ := anypb.New(&api.OriginAttribute{Origin: 0})
	nhAttr, _ := anypb.New(&api.NextHopAttribute{NextHop: "127.0.0.2"})
	_, err = r.AddPath(ctx, &api.AddPathRequest{TableType: api.TableType_GLOBAL, Path: &api.Path{Family: familyV4, Nlri: nlri, Pattrs: []*anypb.Any{origin, nhAttr}}})
	require.NoError(t, err)
	require.Eventually(t, func() bool { return s.Status(ctx).Peers[0].Received["ipv4"] == 1 }, 30*time.Second, 50*time.Millisecond, "the speaker received the router's route")
	_, kept := received(t, s.srv)[learned]
	require.False(t, kept, "and kept none")
	require.Len(t, received(t, s.srv), 3, "only its own")

	// A next hop of the wrong family is refused, not announced.
	require.ErrorContains(t, s.Sync(ctx, []Route{{block4, nh4}, {block6, nh4}}), "no address of its family")
}

// TestBGPPeerSettingsReachTheSpeaker: a peer's multihop TTL and the
// password read from its passwordFile (without the file's trailing
// newline) are what GoBGP is given for the session; an unreadable file
// stops Start, naming the peer and the file.
func TestBGPPeerSettingsReachTheSpeaker(t *testing.T) {
	pwFile := t.TempDir() + "/tor1"
	require.NoError(t, os.WriteFile(pwFile, []byte("s3cret\n"), 0o600))
	cfg := Config{ASN: 65001, RestartTime: Duration{7 * time.Second}, Peers: []Peer{
		{Address: "127.0.0.1", ASN: 65000, Port: 1, Multihop: 3, PasswordFile: pwFile}}}
	ctx := context.Background()
	o := Options{Node: "n1", RouterID: netip.MustParseAddr("127.0.0.1"), Logger: hclog.NewNullLogger()}
	s, err := Start(ctx, cfg, o)
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Stop(context.Background()) })
	require.NoError(t, s.Sync(ctx, nil))
	var got *api.Peer
	require.NoError(t, s.srv.ListPeer(ctx, &api.ListPeerRequest{}, func(p *api.Peer) { got = p }))
	require.NotNil(t, got)
	require.True(t, got.GetEbgpMultihop().GetEnabled())
	require.Equal(t, uint32(3), got.GetEbgpMultihop().GetMultihopTtl())
	require.Equal(t, "s3cret", got.GetConf().GetAuthPassword())

	cfg.Peers[0].PasswordFile = pwFile + ".missing"
	_, err = Start(ctx, cfg, o)
	require.ErrorContains(t, err, "bgp: peer 127.0.0.1: passwordFile "+pwFile+".missing: read:")
}
