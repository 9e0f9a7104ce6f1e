package e2e

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/internal/tools/benchreport"
)

// The goals for a live migration's move, as users feel it.
const (
	goalCutover   = 250 * time.Millisecond
	goalLostPings = 25
	pingEvery     = 10 * time.Millisecond
)

// BenchmarkMigration measures live migration's moves as users feel them,
// for each way pods reach other nodes (routing host-gw, vxlan, bgp with
// FRR as the router), IPv4 and IPv6 (the VM is dual-stack: each move
// moves both, each measured by its own pings and routes). A client pod on
// node 3 pings the VM's two addresses every 10 ms; the VM moves back and
// forth between nodes 1 and 2, KVIPAM_MIGRATION_MOVES times (default
// 20), each move as KubeVirt makes it: the target pod's ADD on the other
// node, then at one instant the source stops answering (its pod's
// interface down: the guest left it) and the guest announces itself
// from the target pod (a gratuitous ARP and an unsolicited neighbour
// advertisement: the trigger; the target's agent cuts over on it), then
// the source pod's DEL.
//
// Per move and family it measures (a) the pings lost, every unanswered
// one from the target's ADD to the next move's (the ADD and the DEL
// count too), and (b) the cut-over time: from the trigger until the
// kernel of every node (and, in bgp mode, the router's, which FRR
// programs) sends the address to the target (ip route get, asked again
// at every route change netlink reports in that namespace). It reports
// the p50 and p99 of (b), the max of (a), each namespace's p99 and the
// trigger's own time (kvipamctl's run, which ends with etcd's commit),
// where the time goes: the trigger to etcd's commit (the binding's
// Since, which the target's agent stamps just before it: the
// announcement seen and the cut-over's transaction), the commit to each
// namespace's route (node1, node2: the source and target by turns;
// node3: the client's; router); in bgp mode the longest the router had
// two next hops for the address; and the load average when it began.
//
//	go test -run '^$' -bench '^BenchmarkMigration$' -benchtime 1x -timeout 30m ./e2e/
func BenchmarkMigration(b *testing.B) {
	moves := 20
	if s := os.Getenv("KVIPAM_MIGRATION_MOVES"); s != "" {
		n, err := strconv.Atoi(s)
		require.NoError(b, err, "KVIPAM_MIGRATION_MOVES")
		moves = n
	}
	for _, routing := range []string{"host-gw", "vxlan", "bgp"} {
		b.Run("routing="+routing, func(b *testing.B) { benchMoves(b, routing, moves) })
	}
}

// families are the VM's address families, by index into moveRig.x.
var families = [2]string{"ipv4", "ipv6"}

// namespaceRoles name the namespaces of moveRig.namespaces in a report:
// nodes 1 and 2 are the source and target by turns.
var namespaceRoles = []string{"node1", "node2", "node3", "router"}

func benchMoves(b *testing.B, routing string, moves int) {
	load := loadAverage(b)
	m := startMoveRig(b, routing)
	client := newPod(b, "mv3-client")
	m.nodes[2].n.mustAdd(m.nodes[2].l, client)
	var pingers [2]*pinger
	for f := range families {
		pingers[f] = startPinger(b, client.ns, m.x[f], pingEvery)
		pingers[f].awaitAnswers(b, 30*time.Second, time.Time{}, 10)
	}
	w := watchRoutes(b, m.namespaces(), m.x[0], m.x[1])
	router := len(m.nodes) // the router's index in the watch, in bgp mode

	var cutover [2][]time.Duration
	var lost [2][]int
	var overlap [2]time.Duration
	each := make([][2][]time.Duration, len(m.namespaces()))
	var commits []time.Duration
	var begins []time.Time
	b.ResetTimer()
	for range moves {
		to := m.nodes[0]
		if m.vmNode == to {
			to = m.nodes[1]
		}
		begins = append(begins, time.Now())
		source := m.vm
		target := m.admit(to)
		var want [2][]func(hop) bool
		for f := range families {
			want[f] = m.towards(to, target, m.x[f])
		}

		moves := m.guestMoves(target)
		trigger := time.Now()
		moves()
		for f := range families {
			w.await(b, 30*time.Second, m.x[f], want[f])
		}
		settled := time.Now()
		for f := range families {
			pingers[f].awaitAnswers(b, 30*time.Second, settled, 10)
		}
		// The cut-over's transaction stamps the binding (Since) just
		// before its commit: trigger to commit, then commit to routes.
		commit := m.binding().Since.Sub(trigger)
		commits = append(commits, commit)
		require.NoError(b, m.vmNode.n.del(m.vmNode.l, source))
		m.vm, m.vmNode = target, to
		waitFor(b, 20*time.Second, "the binding to lose its second owner (the source's DEL)", func() bool { return m.binding().Alternate == nil })

		for f := range families {
			d, byNS := w.converged(trigger, m.x[f], want[f])
			cutover[f] = append(cutover[f], d)
			if d > goalCutover { // where its time went
				var after []string
				for i, e := range byNS {
					after = append(after, fmt.Sprintf("%s %s", namespaceRoles[i], (e-commit).Round(time.Millisecond)))
				}
				b.Logf("%s move %d, %s: %s, over the goal: the announcement to etcd's commit %s; the commit to each namespace's route: %s (%s is the target's node)",
					routing, len(commits), families[f], d.Round(time.Millisecond), commit.Round(time.Millisecond), strings.Join(after, ", "), to.n.name)
			}
			for i, e := range byNS {
				each[i][f] = append(each[i][f], max(e-commit, 0))
			}
			if m.routing == "bgp" {
				overlap[f] = max(overlap[f], w.longestOverlap(trigger, router, m.x[f]))
			}
		}
	}
	// The last move's window: until its pings are answered again, less
	// the time an answer takes to come back.
	end := time.Now()
	for f := range families {
		pingers[f].awaitAnswers(b, 30*time.Second, end, 20)
	}
	b.StopTimer()
	begins = append(begins, end)
	for f := range families {
		for i := range moves {
			lost[f] = append(lost[f], pingers[f].lostBetween(begins[i], begins[i+1]))
		}
	}
	finish(pingers[0], pingers[1])

	series := map[string][]time.Duration{}
	for f, fam := range families {
		series[fam+"-cutover"] = cutover[f]
		for _, n := range lost[f] {
			series[fam+"-unanswered"] = append(series[fam+"-unanswered"], time.Duration(n)*pingEvery)
		}
		b.ReportMetric(ms(pct(cutover[f], 50)), fam+"-cutover-p50-ms")
		b.ReportMetric(ms(pct(cutover[f], 99)), fam+"-cutover-p99-ms")
		b.ReportMetric(float64(maxInt(lost[f])), fam+"-lost-pings-max")
		for i := range each {
			b.ReportMetric(ms(pct(each[i][f], 99)), fmt.Sprintf("%s-%s-after-commit-p99-ms", fam, namespaceRoles[i]))
		}
		if m.routing == "bgp" {
			b.ReportMetric(ms(overlap[f]), fam+"-two-next-hops-max-ms")
		}
		b.Logf("%s %s: cut-over %v; lost pings %v", routing, fam, cutover[f], lost[f])
	}
	b.ReportMetric(ms(pct(commits, 50)), "trigger-to-commit-p50-ms")
	b.ReportMetric(ms(pct(commits, 99)), "trigger-to-commit-p99-ms")
	b.ReportMetric(load, "loadavg-1m")
	b.ReportMetric(ms(goalCutover), "goal-cutover-ms")
	b.ReportMetric(goalLostPings, "goal-lost-pings")
	writeSamples(b, benchreport.Samples{Runs: moves}, series, nil)
}

// loadAverage is the machine's load average over the last minute: the
// other work the measurement shared the CPUs with.
func loadAverage(b *testing.B) float64 {
	raw, err := os.ReadFile("/proc/loadavg")
	require.NoError(b, err)
	var l float64
	_, err = fmt.Sscan(string(raw), &l)
	require.NoError(b, err)
	return l
}

func maxInt(xs []int) int {
	n := 0
	for _, x := range xs {
		n = max(n, x)
	}
	return n
}
