package e2e

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/e2e/cluster"
	"github.com/kvipam/kvipam/internal/testsupport/nstest"
)

// TestClusterAgentRollingRestart restarts each node's agent in turn, as a
// rolling upgrade does, while pods on the two nodes ping each other every
// 10 ms. The agents use a 3-member etcd cluster (member processes). No
// route or link in either node namespace is removed, re-added or changed
// during the restarts (netlink is watched), the datapath's eBPF
// attachments stay the same ones, each restart costs at most one interval of
// lost packets (in practice none), and no pod's address changes.
func TestClusterAgentRollingRestart(t *testing.T) {
	c := cluster.Start(t, cluster.Options{})
	a, b := newNode(t, "ra"), newNode(t, "rb")
	underlay(t, a, b)
	const pool = "default=10.6.0.0/16"
	start := func(n *node, addr string) {
		n.startAgent(agentOpts{pools: []string{pool}, etcd: c, extra: []string{"--node-address", addr}})
	}
	start(a, "10.254.0.1")
	start(b, "10.254.0.2")
	la, lb := a.kvipamList("kv", "1.0.0", ""), b.kvipamList("kv", "1.0.0", "")
	pa, pb := newPod(t, "rpa"), newPod(t, "rpb")
	ipa, _ := podAddrs(t, a.mustAdd(la, pa))
	ipb, _ := podAddrs(t, b.mustAdd(lb, pb))
	blockA, blockB := a.poolStatus("default", "ipv4").Blocks[0], b.poolStatus("default", "ipv4").Blocks[0]
	waitFor(t, 10*time.Second, "each node to route the other's block", func() bool {
		return hasRoute(nlHandle(t, a.host), blockB, "10.254.0.2") && hasRoute(nlHandle(t, b.host), blockA, "10.254.0.1")
	})
	require.NoError(t, ping(pa.ns, ipb))
	require.NoError(t, ping(pb.ns, ipa))

	addrsBefore := map[string][]string{a.name: endpointIPs(t, a), b.name: endpointIPs(t, b)}
	attachedBefore := map[string]map[string]string{a.name: attachments(t, a), b.name: attachments(t, b)}
	if datapathFlag() == "bpf" {
		require.NotEmpty(t, attachedBefore[a.name], "the bpf datapath attaches its program to each endpoint")
	}
	watches := map[string]*nlWatch{a.name: watchNetlink(t, a.host), b.name: watchNetlink(t, b.host)}
	const every = 10 * time.Millisecond
	pingers := []*pinger{startPinger(t, pa.ns, ipb, every), startPinger(t, pb.ns, ipa, every)}
	began := time.Now()
	// Traffic flows before the first restart.
	waitFor(t, 30*time.Second, "pings answered", func() bool { return pingers[0].answeredSince(began) > 10 })

	restarts := 0
	for _, n := range []*node{a, b} {
		synced := strings.Count(readLog(t, n), "peer routes in sync")
		took := time.Now()
		n.restartAgent()
		ready := time.Since(took)
		restarts++
		// The restarted agent has listed homes and nodes and compared
		// its routes with them: after this, a flapping route would have
		// flapped.
		waitFor(t, 10*time.Second, n.name+"'s restarted agent to sync its peer routes", func() bool {
			return strings.Count(readLog(t, n), "peer routes in sync") > synced
		})
		after := time.Now()
		// A second of traffic after it: a late flap would show.
		waitFor(t, 10*time.Second, "pings answered after the restart of "+n.name, func() bool {
			return pingers[0].answeredSince(after) >= 100 && pingers[1].answeredSince(after) >= 100
		})
		t.Logf("%s: agent restarted and ready in %s", n.name, ready.Round(time.Millisecond))
	}
	finish(pingers...)
	ended := time.Now()

	for _, p := range pingers {
		runs, sent := p.losses()
		lost := 0
		for _, r := range runs {
			lost += r.lost
		}
		t.Logf("ping to %s: %d sent every %s over %s, %d lost in %d intervals %v", p.dst, sent, every, p.sent[len(p.sent)-1].Sub(p.sent[0]).Round(time.Millisecond), lost, len(runs), runs)
		require.LessOrEqual(t, len(runs), restarts, "at most one lost interval per restart")
	}
	for name, w := range watches {
		require.Empty(t, w.between(began, ended), "no route or link of %s changed during the restarts", name)
	}
	for _, n := range []*node{a, b} {
		require.Equal(t, addrsBefore[n.name], endpointIPs(t, n), "%s's pods keep their addresses", n.name)
		require.Equal(t, attachedBefore[n.name], attachments(t, n), "%s's datapath attachments are the same ones", n.name)
	}
	require.NoError(t, a.check(la, pa))
	require.NoError(t, b.check(lb, pb))
	require.NoError(t, a.del(la, pa))
	require.NoError(t, b.del(lb, pb))
}

// underlay joins two nodes' namespaces on one L2 segment: ul0 at both
// ends, 10.254.0.1/24 on a and 10.254.0.2/24 on b.
func underlay(t *testing.T, a, b *node) { nstest.Underlay(t, a.host, b.host) }

// endpointIPs are the addresses of the node's endpoints, as its agent
// reports them, in order.
func endpointIPs(t *testing.T, n *node) []string {
	t.Helper()
	eps, err := n.client().Endpoints(context.Background())
	require.NoError(t, err)
	var out []string
	for _, ep := range eps {
		for _, ip := range ep.IPs {
			out = append(out, ep.Owner.ContainerID+"="+ip.String())
		}
	}
	return out
}

// attachments are how the datapath's program is attached to each of the
// node's endpoints (the TCX link or the clsact filter's program), by
// container ID; empty in the routes datapath.
func attachments(t *testing.T, n *node) map[string]string {
	t.Helper()
	eps, err := n.client().Endpoints(context.Background())
	require.NoError(t, err)
	out := map[string]string{}
	for _, ep := range eps {
		if how := n.attachmentOf(t, ep.HostIfIndex); how != "" {
			out[ep.Owner.ContainerID] = how
		}
	}
	return out
}

// readLog is the node's whole agent log (every start appends to it).
func readLog(t *testing.T, n *node) string {
	t.Helper()
	b, err := os.ReadFile(n.agentLog)
	require.NoError(t, err)
	return string(b)
}
