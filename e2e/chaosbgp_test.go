package e2e

import (
	"fmt"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/e2e/chaos"
	"github.com/kvipam/kvipam/routing/bgp"
)

// The chaos run with CHAOS_ROUTING=bgp: every agent runs in its node's
// namespace (its BGP sessions are the process's) and announces to FRR in
// the router namespace; it reaches etcd through proxies listening in that
// namespace, which the run cuts as before. With the lease TTL of 5 s the
// graceful-restart time is 2 s; the nodes propose a hold time of 3 s.
const (
	chaosLeaseTTL = 5 * time.Second
	chaosHold     = 3 * time.Second
)

// The checker's bounds, each with a second more for the router's, the
// recorder's and the poll's own delays.
//
// chaosBlockBound is how long a block may have two announcers, or be
// announced without the node's claim: a node that vanishes without
// closing its session (an agent paused past its lease) keeps its routes
// in the router until the hold time expires, which is the hold time less
// the restart time after etcd can expire its lease at the earliest.
//
// chaosHostBound is the same for a borrowed address, which moves between
// live nodes (returned and borrowed again, or a sticky identity's taken
// over by its next pod): the former holder withdraws it when its watch of
// homes sees the move, and if its agent is down then, the router keeps it
// for the restart time (agent exited) or the hold time (vanished) at most.
var (
	chaosBlockBound = chaosHold - bgp.MaxRestartTime(chaosLeaseTTL) + time.Second
	chaosHostBound  = max(chaosHold, bgp.MaxRestartTime(chaosLeaseTTL)) + time.Second
)

// chaosRouting is CHAOS_ROUTING: "" (the agents route host-gw into their
// node namespaces from the test's own) or "bgp".
func chaosRouting(t *testing.T) string {
	r := os.Getenv("CHAOS_ROUTING")
	require.Contains(t, []string{"", "bgp"}, r, "CHAOS_ROUTING is empty or bgp")
	return r
}

// chaosBGP is a chaos run's BGP fabric: FRR as the router of every node,
// and a poll of its IPv4 table (the chaos pool's family).
type chaosBGP struct {
	frr   *frr
	names map[netip.Addr]string
	poll  *frrPoller
}

// startChaosBGP starts FRR in r's namespace, peered with the nodes at
// hosts .11 and on of subnet A.
func startChaosBGP(t *testing.T, r *router, nodes int) *chaosBGP {
	var peers []frrPeer
	for i := range nodes {
		peers = append(peers, frrPeer{addr: netip.MustParseAddr(fmt.Sprintf("%s.%d", subnetPrefix("A"), 11+i))})
	}
	return &chaosBGP{frr: startFRR(t, r.ns, frrConf(peers)), names: map[netip.Addr]string{}}
}

// agentBGP is node n's bgp section (the agent runs with routing bgp).
func (b *chaosBGP) agentBGP(n *node, addr netip.Addr) map[string]any {
	b.names[addr] = n.name
	peer := map[string]any{"address": subnetPrefix("A") + ".1", "asn": 65000, "holdTime": chaosHold.String(), "keepaliveTime": (chaosHold / 3).String()}
	return map[string]any{"asn": 65001, "peers": []any{peer}}
}

// start waits for every session, then polls FRR until the run ends.
func (b *chaosBGP) start(t *testing.T, members []*chaosNode) {
	for _, m := range members {
		waitFor(t, 60*time.Second, "FRR's session with "+m.n.name, func() bool { return b.frr.established(m.addr) })
	}
	b.poll = pollFRR(t, b.frr, b.names, []string{"ipv4"}, 200*time.Millisecond)
}

// check stops the poll and checks what FRR heard against etcd's history:
// no prefix with two announcers, and no announcement without the node's
// claim behind it, for the bound or longer. It returns the findings and
// the run's figures for its summary line.
func (b *chaosBGP) check(t *testing.T, backing []chaos.Backing, members []*chaosNode) ([]chaos.Finding, string) {
	polls := b.poll.stop()
	blocks, hosts := chaos.SplitHosts(polls)
	var findings []chaos.Finding
	var figures []string
	for _, k := range []struct {
		what  string
		polls []chaos.RouterPoll
		bound time.Duration
	}{{"blocks", blocks, chaosBlockBound}, {"borrowed", hosts, chaosHostBound}} {
		for _, fd := range chaos.DoubleAnnounced(k.polls, 0) {
			t.Logf("bgp %s: %s", k.what, fd.Message) // the faults' log says which fault it followed
		}
		doubles := chaos.DoubleAnnounced(k.polls, k.bound)
		unbacked := chaos.Unbacked(k.polls, backing, k.bound)
		longest, runs := chaos.LongestDoubleAnnounced(k.polls)
		findings = append(append(findings, doubles...), unbacked...)
		figures = append(figures, fmt.Sprintf("%s: double-announced=%d unbacked=%d (two announcers seen %d times, longest %s; bound %s)",
			k.what, len(doubles), len(unbacked), runs, longest.Round(time.Millisecond), k.bound))
	}
	prefixes := map[netip.Prefix]bool{}
	for _, p := range polls {
		for pfx := range p.Announcers {
			prefixes[pfx] = true
		}
	}
	fenced := 0
	for _, m := range members {
		if log, err := os.ReadFile(m.n.agentLog); err == nil {
			fenced += strings.Count(string(log), "bgp announcements withdrawn: the node lease is not proven")
		}
	}
	return findings, fmt.Sprintf("bgp: polls=%d prefixes=%d lease-withdrawals=%d %s", len(polls), len(prefixes), fenced, strings.Join(figures, " "))
}
