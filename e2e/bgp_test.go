package e2e

import (
	"net/netip"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"
)

// TestBGPTwoRacksWithFRR: nodes in two racks (different subnets, joined
// by a router that runs FRR and has no route to any pod prefix but what
// BGP brings) announce their homes with routing bgp. Node a1 and b3 claim
// the pool's two IPv4 blocks; a2, which finds none free, borrows one
// address. FRR's IPv4 table holds exactly one prefix per claimed block
// and one /32 per borrowed address, each with its node as next hop (IPv6
// alike, over the same sessions: MP-BGP), the router's kernel routes them
// from BGP, and every dual-stack pod pings every other. One session uses
// a TCP MD5 password and a community of its own; every announcement
// carries the nodes' common community.
func TestBGPTwoRacksWithFRR(t *testing.T) {
	f := newBGPFabric(t, []bgpNodeSpec{{name: "a1", rack: "A", host: 11, metrics: "127.0.0.1:9464"}, {name: "b3", rack: "B", host: 13, password: "s3cret", community: "65001:300"}, {name: "a2", rack: "A", host: 12}})
	a1, b3, a2 := f.nodes[0], f.nodes[1], f.nodes[2]
	a1.addPod(t, "a1-p0")
	b3.addPod(t, "b3-p0")
	borrowed := a2.addPod(t, "a2-p0")
	require.Empty(t, a2.n.poolStatus("default", "ipv4").Blocks, "a2 claimed no IPv4 block")
	require.Equal(t, 1, a2.n.poolStatus("default", "ipv4").Borrowed, "a2 borrowed its pod's address")
	require.Len(t, a1.n.poolStatus("default", "ipv4").Blocks, 1)
	require.Len(t, b3.n.poolStatus("default", "ipv4").Blocks, 1)

	f.waitTables(t)
	out, err := f.frr.vtysh("show bgp ipv4 unicast")
	require.NoError(t, err)
	t.Logf("show bgp ipv4 unicast:\n%s", out)
	v4 := f.frr.nextHops("ipv4")
	require.Len(t, v4, 3, "two blocks and one borrowed address")
	require.Equal(t, a2.v4, v4[netip.PrefixFrom(borrowed[0], 32)], "the borrowed address, via the node that holds it")
	for _, b := range f.nodes {
		for _, blk := range b.n.poolStatus("default", "ipv4").Blocks {
			require.Equal(t, b.v4, v4[blk], "%s's block %s via %s", b.n.name, blk, b.n.name)
		}
	}
	for _, fam := range []string{"ipv4", "ipv6"} {
		for p := range f.expected(t, fam) {
			waitFor(t, 10*time.Second, "the router's kernel to route "+p.String()+" from BGP", func() bool {
				ok, fromBGP := f.routerRoute(t, p)
				return ok && fromBGP
			})
		}
	}
	// The nodes route no pod prefix of another node: only their default
	// routes to the router.
	for _, b := range f.nodes {
		for _, fam := range []int{netlink.FAMILY_V4, netlink.FAMILY_V6} {
			routes, err := nlHandle(t, b.n.host).RouteListFiltered(fam, &netlink.Route{Protocol: 0x6b}, netlink.RT_FILTER_PROTOCOL)
			require.NoError(t, err)
			require.Empty(t, routes, "%s programs no route to other nodes", b.n.name)
		}
	}
	f.pingAll(t)

	// Every announcement carries the global community, b3's also its
	// session's own.
	require.Len(t, f.frr.withCommunity("ipv4", "65001:100"), 3)
	require.Len(t, f.frr.withCommunity("ipv6", "65001:100"), 3)
	var b3v4 []netip.Prefix
	for p, nh := range f.expected(t, "ipv4") {
		if nh == b3.v4 {
			b3v4 = append(b3v4, p)
		}
	}
	require.ElementsMatch(t, b3v4, f.frr.withCommunity("ipv4", "65001:300"), "b3's session's own community")

	st := a1.n.status()
	require.NotNil(t, st.BGP)
	require.Len(t, st.BGP.Peers, 1)
	require.Equal(t, "established", st.BGP.Peers[0].State)
	require.Equal(t, map[string]int{"ipv4": 1, "ipv6": 1}, st.BGP.Announced)
	require.Equal(t, map[string]uint64{"ipv4": 1, "ipv6": 1}, st.BGP.Peers[0].Advertised, "its block of each family, sent to the router")
	adv, err := f.frr.vtysh("show bgp ipv4 unicast neighbors " + a1.v4.String() + " advertised-routes json")
	require.NoError(t, err)
	require.NotContains(t, string(adv), `"10.9.`, "the router sends the nodes nothing (its NODES-OUT route-map): %s", adv)
	require.Equal(t, map[string]uint64{"ipv4": 0, "ipv6": 0}, st.BGP.Peers[0].Received)
	ctl, err := exec.Command(a1.n.bin+"/kvipamctl", "agent", "status", "--socket", a1.n.socket).CombinedOutput()
	require.NoError(t, err, "%s", ctl)
	t.Logf("kvipamctl agent status on a1:\n%s", ctl)
	require.Contains(t, string(ctl), "established")
	metrics := scrape(t, a1.n, "127.0.0.1:9464")
	require.Contains(t, metrics, `kvipam_bgp_peer_up{peer="10.254.1.1",peer_asn="65000"} 1`)
	require.Contains(t, metrics, `kvipam_bgp_announced_prefixes{family="ipv4"} 1`)

	for _, b := range f.nodes {
		for _, p := range b.pods {
			require.NoError(t, b.n.del(b.l, p))
		}
	}
}

// TestBGPGracefulRestart: while a pod on each of two nodes pings the
// other every 10 ms, node b3's agent restarts (SIGTERM, start again).
// The session drops with the agent's process; FRR, a graceful-restart
// helper, keeps b3's routes (and its kernel keeps forwarding) until the
// new agent has re-announced them and sent End-of-RIB. No ping is lost
// beyond one interval, and the router's kernel never deletes a route to
// b3's prefixes.
func TestBGPGracefulRestart(t *testing.T) {
	f := newBGPFabric(t, []bgpNodeSpec{{name: "g1", rack: "A", host: 11}, {name: "g3", rack: "B", host: 13}})
	a, b := f.nodes[0], f.nodes[1]
	pa, pb := a.addPod(t, "g1-p0"), b.addPod(t, "g3-p0")
	f.waitTables(t)
	f.pingAll(t)
	prefixes := []string{}
	for fam, want := range map[string]map[netip.Prefix]netip.Addr{"ipv4": f.expected(t, "ipv4"), "ipv6": f.expected(t, "ipv6")} {
		_ = fam
		for p, nh := range want {
			if nh == b.v4 || nh == b.v6 {
				prefixes = append(prefixes, p.String())
			}
		}
	}
	require.Len(t, prefixes, 2, "b3's IPv4 and IPv6 blocks")

	w := watchNetlink(t, f.r.ns)
	p1 := startPinger(t, a.pods[0].ns, pb[0], 10*time.Millisecond)
	p2 := startPinger(t, b.pods[0].ns, pa[0], 10*time.Millisecond)
	waitFor(t, 10*time.Second, "both pingers answered", func() bool {
		return p1.answeredSince(time.Time{}) > 10 && p2.answeredSince(time.Time{}) > 10
	})
	synced := strings.Count(readLog(t, b.n), "bgp announcements in sync")
	before := f.frr.neighbor(b.v4)
	from := time.Now()
	b.n.restartAgent()
	waitFor(t, 30*time.Second, "the restarted agent to announce again", func() bool {
		return strings.Count(readLog(t, b.n), "bgp announcements in sync") > synced
	})
	waitFor(t, 60*time.Second, "FRR's session with the restarted agent, its routes no longer stale", func() bool {
		if !f.frr.established(b.v4) {
			return false
		}
		for _, fam := range []string{"ipv4", "ipv6"} {
			for _, path := range f.frr.routes(fam) {
				if path.Stale {
					return false
				}
			}
		}
		return true
	})
	back := time.Now()
	after := f.frr.neighbor(b.v4)
	t.Logf("agent restarted; FRR established again with fresh routes %s after the restart began (session dropped: %q)", back.Sub(from).Round(time.Millisecond), after.ResetDueTo)
	require.Greater(t, after.Dropped, before.Dropped, "the session did drop with the agent's process")
	since := time.Now()
	waitFor(t, 10*time.Second, "pings after the restart", func() bool {
		return p1.answeredSince(since) > 20 && p2.answeredSince(since) > 20
	})
	finish(p1, p2)
	for i, p := range []*pinger{p1, p2} {
		runs, sent := p.losses()
		t.Logf("pinger %d: %d sent, loss runs %v", i+1, sent, runs)
		for _, r := range runs {
			if r.to.After(from) || r.from.After(from) {
				require.LessOrEqual(t, r.lost, 1, "no ping lost beyond one interval: %s", r)
			}
		}
	}
	for _, e := range w.between(from, time.Now()) {
		if strings.Contains(e, "route delete") {
			for _, p := range prefixes {
				require.NotContains(t, e, p+" ", "the router never withdrew b3's prefix")
			}
		}
	}
	f.waitTables(t)
}

// TestBGPWithdraw: a block given back (its pool disabled and emptied) is
// withdrawn: FRR drops it, and the router's kernel deletes its route
// (the latency from the give-back is logged). Then node b3 dies: every
// packet to and from it is dropped, as when it loses power, and its
// agent is killed. FRR withdraws b3's prefixes when the hold time (3 s,
// keepalive 1 s) expires, and no sooner.
func TestBGPWithdraw(t *testing.T) {
	const hold, keepalive = 3 * time.Second, time.Second
	f := newBGPFabric(t, []bgpNodeSpec{{name: "w1", rack: "A", host: 11}, {name: "w3", rack: "B", host: 13, hold: hold}})
	a, b := f.nodes[0], f.nodes[1]
	a.addPod(t, "w1-p0")
	b.addPod(t, "w3-p0")
	f.waitTables(t)

	// Give a1's block back: a1's only pod goes, and the pool is disabled,
	// so the agent gives its empty blocks back.
	blk := a.n.poolStatus("default", "ipv4").Blocks[0]
	require.NoError(t, a.n.del(a.l, a.pods[0]))
	a.pods, a.ips = nil, nil
	w := watchNetlink(t, f.r.ns)
	var out []byte
	// From before the command: the agent may give the block back, and the
	// router delete its route, before kvipamctl has returned.
	disabled := time.Now()
	require.NoError(t, a.n.do(func() (err error) {
		out, err = exec.Command(a.n.bin+"/kvipamctl", "pool", "disable", "default", "--endpoints", "http://"+a.v4.String()+":2379").CombinedOutput()
		return err
	}), "%s", out)
	waitFor(t, 30*time.Second, "FRR to withdraw the given-back block "+blk.String(), func() bool {
		_, ok := f.frr.nextHops("ipv4")[blk]
		return !ok
	})
	var deleted time.Time
	waitFor(t, 10*time.Second, "the router's kernel to delete the route", func() bool {
		var ok bool
		deleted, ok = w.first(disabled, "route delete "+blk.String()+" ")
		return ok
	})
	t.Logf("block %s given back: the router deleted its route %s after kvipamctl pool disable began", blk, deleted.Sub(disabled).Round(time.Millisecond))
	require.Len(t, a.n.poolStatus("default", "ipv4").Blocks, 0)

	// b3 dies.
	bp := f.expected(t, "ipv4")
	var b4 netip.Prefix
	for p, nh := range bp {
		if nh == b.v4 {
			b4 = p
		}
	}
	require.True(t, b4.IsValid())
	for _, chain := range []string{"INPUT", "OUTPUT"} {
		out, err := exec.Command("nsenter", "--net="+b.n.host.Path(), "iptables", "-I", chain, "-j", "DROP").CombinedOutput()
		require.NoError(t, err, "%s", out)
	}
	died := time.Now()
	b.n.killAgent()
	waitFor(t, 60*time.Second, "FRR to withdraw the dead node's prefixes", func() bool {
		_, ok := f.frr.nextHops("ipv4")[b4]
		return !ok
	})
	gone := time.Since(died)
	t.Logf("node b3 died: FRR withdrew its prefixes %s later (hold time %s, keepalive %s); FRR: %q", gone.Round(time.Millisecond), hold, keepalive, f.frr.neighbor(b.v4).ResetDueTo)
	require.GreaterOrEqual(t, gone, hold-keepalive, "not before the hold time (less the keepalive interval since the last keepalive)")
	require.Empty(t, f.frr.nextHops("ipv6"), "both families withdrawn")
}
