package benchreport

import (
	"bytes"
	"encoding/json"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

const sample = `goos: linux
BenchmarkAddDel/concurrency=1-2         	     200	  73184341 ns/op	         0.8955 add-p50-ratio	        11.53 bridge-add-p50-ms	        20.24 bridge-del-p50-ms	        10.32 kvipam-add-p50-ms	        21.57 kvipam-del-p50-ms
BenchmarkAddDel/concurrency=50-2        	     200	  24954990 ns/op	       512.7 bridge-add-p50-ms	       230.7 kvipam-add-p50-ms
    bench_test.go:12: BenchmarkNotAResult is a log line
PASS
`

// TestReportFromBenchOutput: figures come out of go test -bench output
// with their baselines and ratios; what is missing is named, not guessed.
func TestReportFromBenchOutput(t *testing.T) {
	rs, err := Parse(strings.NewReader(sample))
	require.NoError(t, err)
	require.Len(t, rs, 2)
	require.Equal(t, "BenchmarkAddDel/concurrency=1", rs[0].Name)
	require.InDelta(t, 10.32, rs[0].Metrics["kvipam-add-p50-ms"], 1e-9)

	figs, missing := Figures(map[string][]Result{"adddel": rs})
	byName := byNameOf(figs)
	add := byName["cni.add.p50.default_vs_bridge"]
	require.InDelta(t, 10.32, add.Value, 1e-9)
	require.InDelta(t, 11.53, add.Baseline, 1e-9)
	require.InDelta(t, 0.895, add.Ratio, 1e-9)
	require.Contains(t, byName, "cni.del.p50.default_vs_bridge")
	require.Contains(t, byName, "cni.add.p50.c50.default_vs_bridge")
	require.Contains(t, missing, "scale.claim5000.seconds")
	require.Contains(t, missing, "agent.rss.10k_mb")
	require.NotContains(t, missing, "cni.add.p50.default_vs_bridge")

	var js bytes.Buffer
	require.NoError(t, WriteJSON(&js, figs))
	var back []map[string]any
	require.NoError(t, json.Unmarshal(js.Bytes(), &back))
	require.Equal(t, []string{"baseline", "name", "ratio", "source", "unit", "value"}, keys(back[0]))

	var md bytes.Buffer
	require.NoError(t, WriteMarkdown(&md, Machine{CPU: "test", CPUs: 2}, []string{"go test -bench AddDel ./e2e/"}, figs, missing, nil))
	require.Contains(t, md.String(), "| `cni.add.p50.default_vs_bridge` | 10.32 ms | 11.53 | 0.895 | bridge + host-local |")
	require.Contains(t, md.String(), "`scale.150k.max_rate`: its benchmark's output is missing from this run")
}

// TestAgentRSS: the agent's resident set with 10,000 allocations stands
// beside its resident set idle.
func TestAgentRSS(t *testing.T) {
	byName, _ := figuresFrom(t, map[string]string{"restart": "BenchmarkAgentRestart-2   	       5	 250133214 ns/op	        41.79 MB/rss-10k	        32.04 MB/rss-idle	         0.2445 s/restart-10k\n"})
	require.InDelta(t, 32.04, byName["agent.rss.idle_mb"].Value, 1e-9)
	require.InDelta(t, 41.79, byName["agent.rss.10k_mb"].Value, 1e-9)
	require.InDelta(t, 32.04, byName["agent.rss.10k_mb"].Baseline, 1e-9)
	require.InDelta(t, 1.304, byName["agent.rss.10k_mb"].Ratio, 1e-9)
}

// TestStormFigures: the 5,000-node storm's try-agains and its ratio to
// as many bare transactions (goal: at most 2), and the 10,000-node
// storm's, from its own output file.
func TestStormFigures(t *testing.T) {
	line := "BenchmarkClaimStorm/etcd=cluster3-2   	       1	 2000000000 ns/op	 1.000 s/baseline	 1.800 s/storm	 1.8 x-baseline	 0 try-again	 0 failures	 0 lost-leases	 0 duplicates	 210.5 etcd-rss-mb	 150 first-end-ms	 100 baseline-first-end-ms\n"
	byName, missing := figuresFrom(t, map[string]string{"storm": line, "storm10k": line})
	require.InDelta(t, 1.8, byName["scale.claim5000.vs_raw"].Ratio, 1e-9)
	require.Contains(t, byName, "scale.claim5000.try_again")
	require.InDelta(t, 1.8, byName["scale.claim10000.seconds"].Value, 1e-9)
	require.InDelta(t, 210.5, byName["scale.claim10000.etcd_rss_mb"].Value, 1e-9)
	require.InDelta(t, 1.5, byName["scale.claim5000.first_ms"].Ratio, 1e-9)
	require.NotContains(t, missing, "scale.claim10000.seconds")
}

// TestClaimCostFigures: a storm's transactions one kind at a time, each
// over as many bare creates (BenchmarkClaimCost, output file
// claimcost.txt).
func TestClaimCostFigures(t *testing.T) {
	line := "BenchmarkClaimCost/etcd=cluster3-2   \t       1\t 0.700 s/bare\t 1.050 s/claim-first\t 1.120 s/lost\t 0.980 s/claim\t 0.710 s/bare-again\t 1.1 etcd-cpu-s/bare\t 0 ns/op\n"
	byName, missing := figuresFrom(t, map[string]string{"claimcost": line})
	require.InDelta(t, 1.5, byName["scale.claim5000.txn.claim_first_vs_bare"].Ratio, 1e-9)
	require.InDelta(t, 1.6, byName["scale.claim5000.txn.lost_vs_bare"].Ratio, 1e-9)
	require.InDelta(t, 1.4, byName["scale.claim5000.txn.claim_vs_bare"].Ratio, 1e-9)
	require.NotContains(t, missing, "scale.claim5000.txn.lost_vs_bare")
}

// TestK8sBurstFigures: the Kubernetes bursts' figures (e2e/k8s
// BenchmarkK8sBurst, output file k8s.txt): at 100 pods, create to Ready
// p50 and p99, the time above the host-network floor and RunPodSandbox,
// kvipam beside bridge+host-local; the single sandbox's from the same
// line; the 30-pod burst's from its own.
func TestK8sBurstFigures(t *testing.T) {
	out := "BenchmarkK8sBurst/burst=30-2   \t       1\t 1500 kvipam-ready-p50-ms\t 2000 bridge-ready-p50-ms\t 400 kvipam-above-floor-ms\t 800 bridge-above-floor-ms\t 0 ns/op\n" +
		"BenchmarkK8sBurst/burst=100-2  \t       1\t 9000 kvipam-ready-p50-ms\t 9500 bridge-ready-p50-ms\t 17000 kvipam-ready-p99-ms\t 17600 bridge-ready-p99-ms" +
		"\t 1500 kvipam-above-floor-ms\t 3100 bridge-above-floor-ms\t 1200 kvipam-routes-above-floor-ms\t 320 kvipam-sandbox-p50-ms\t 400 bridge-sandbox-p50-ms" +
		"\t 90 kvipam-cni-add-p50-ms\t 120 bridge-cni-add-p50-ms\t 250 kvipam-single-sandbox-p50-ms\t 260 bridge-single-sandbox-p50-ms\t 60 kvipam-single-cni-add-p50-ms\t 70 bridge-single-cni-add-p50-ms" +
		"\t 120 kvipam-cpu-above-floor-ms-per-pod\t 200 bridge-cpu-above-floor-ms-per-pod" +
		"\t 6 kvipam-net-cpu-ms-per-pod\t 4 kvipam-net-cpu-kvipam-ms-per-pod\t 2 kvipam-net-cpu-kvipam-agent-ms-per-pod\t 20 bridge-net-cpu-ms-per-pod\t 7 bridge-net-cpu-iptables-ms-per-pod\t 0 ns/op\n"
	rs, err := Parse(strings.NewReader(out))
	require.NoError(t, err)
	require.Len(t, rs, 2)
	require.Equal(t, "BenchmarkK8sBurst/burst=100", rs[1].Name)
	byName, missing := figuresFrom(t, map[string]string{"k8s": out})
	for _, n := range []string{"k8s.burst100.ready_p50.kvipam_vs_bridge", "k8s.burst100.ready_p99.kvipam_vs_bridge", "k8s.burst100.netsetup_p50_ms"} {
		require.Contains(t, byName, n)
		require.NotContains(t, missing, n)
		require.Equal(t, "k8s.txt: BenchmarkK8sBurst/burst=100", byName[n].Source)
	}
	require.InDelta(t, 9000, byName["k8s.burst100.ready_p50.kvipam_vs_bridge"].Value, 1e-9)
	require.InDelta(t, 0.947, byName["k8s.burst100.ready_p50.kvipam_vs_bridge"].Ratio, 1e-9)
	require.InDelta(t, 0.966, byName["k8s.burst100.ready_p99.kvipam_vs_bridge"].Ratio, 1e-9)
	require.InDelta(t, 320, byName["k8s.burst100.netsetup_p50_ms"].Value, 1e-9)
	require.InDelta(t, 400, byName["k8s.burst100.netsetup_p50_ms"].Baseline, 1e-9)
	require.InDelta(t, 0.484, byName["k8s.burst100.above_floor.kvipam_vs_bridge"].Ratio, 1e-9)
	require.InDelta(t, 0.387, byName["k8s.burst100.above_floor.routes_vs_bridge"].Ratio, 1e-9)
	require.InDelta(t, 0.75, byName["k8s.burst100.cni_add_p50_ms"].Ratio, 1e-9)
	require.InDelta(t, 0.6, byName["k8s.burst100.cpu_above_floor.kvipam_vs_bridge"].Ratio, 1e-9)
	// A single sandbox's network set-up is its CNI ADD, RunPodSandbox's
	// network part; the whole RunPodSandbox beside it.
	require.InDelta(t, 60, byName["k8s.single.netsetup_ms"].Value, 1e-9)
	require.InDelta(t, 0.857, byName["k8s.single.netsetup_ms"].Ratio, 1e-9)
	require.InDelta(t, 0.962, byName["k8s.single.sandbox_ms"].Ratio, 1e-9)
	// The network's own CPU a pod, and its split by program.
	require.InDelta(t, 0.3, byName["k8s.burst100.net_cpu_per_pod.kvipam_vs_bridge"].Ratio, 1e-9)
	require.Contains(t, BaselineOf("k8s.burst100.net_cpu_per_pod.kvipam_vs_bridge"), "goal: ratio at most 0.4")
	require.InDelta(t, 2, byName["k8s.burst100.net_cpu_per_pod.kvipam.agent"].Value, 1e-9)
	require.InDelta(t, 7, byName["k8s.burst100.net_cpu_per_pod.bridge.iptables"].Value, 1e-9)
	require.InDelta(t, 0.75, byName["k8s.burst30.ready_p50.kvipam_vs_bridge"].Ratio, 1e-9)
	require.InDelta(t, 0.5, byName["k8s.burst30.above_floor.kvipam_vs_bridge"].Ratio, 1e-9)
	require.Contains(t, BaselineOf("k8s.burst100.above_floor.kvipam_vs_bridge"), "goal: ratio at most 0.5")
	// A metric the line lacks is named missing, not guessed.
	require.Contains(t, missing, "k8s.burst100.ready_p50.routes_vs_bridge")
}

// TestK8sChurnFigures: the churn's figures (e2e/k8s BenchmarkK8sChurn,
// output file k8s.txt): ADD p99 at 10 pods a second beside bridge's, and
// the ceiling of each.
func TestK8sChurnFigures(t *testing.T) {
	out := "BenchmarkK8sChurn/rate=10-2 \t 1\t 120 kvipam-add-p99-ms\t 300 bridge-add-p99-ms\t 0 kvipam-failed-sandboxes\t 0 kvipam-leaks\t 1.02 kvipam-rss-last-x-first\t 0 ns/op\n" +
		"BenchmarkK8sChurn/ceiling-2 \t 1\t 20 kvipam-ceiling-per-s\t 10 bridge-ceiling-per-s\t 0 ns/op\n"
	byName, _ := figuresFrom(t, map[string]string{"k8s": out})
	require.InDelta(t, 120, byName["node.churn10.add_p99_ms"].Value, 1e-9)
	require.InDelta(t, 0.4, byName["node.churn10.add_p99_ms"].Ratio, 1e-9)
	require.InDelta(t, 2, byName["node.churn.ceiling_per_s"].Ratio, 1e-9)
	require.InDelta(t, 0, byName["node.churn10.leaks"].Value, 1e-9)
	require.InDelta(t, 1.02, byName["node.churn10.agent_rss_last_vs_first"].Value, 1e-9)
}

// TestMigrationFigures: live migration's figures (e2e
// BenchmarkMigration, output file migration.txt), per routing and
// family, each beside the goal.
func TestMigrationFigures(t *testing.T) {
	out := "BenchmarkMigration/routing=host-gw-2 \t 1\t 1037529751 ns/op\t 250.0 goal-cutover-ms\t 25.00 goal-lost-pings\t 29.84 ipv4-cutover-p99-ms\t 3.000 ipv4-lost-pings-max\t 31.0 ipv6-cutover-p99-ms\t 2.000 ipv6-lost-pings-max\n" +
		"BenchmarkMigration/routing=bgp-2 \t 1\t 2583754067 ns/op\t 250.0 goal-cutover-ms\t 25.00 goal-lost-pings\t 262.0 ipv4-cutover-p99-ms\t 24.00 ipv4-lost-pings-max\n"
	byName, missing := figuresFrom(t, map[string]string{"migration": out})
	require.InDelta(t, 29.84, byName["migration.cutover_ms.p99.host_gw.ipv4"].Value, 1e-9)
	require.InDelta(t, 250, byName["migration.cutover_ms.p99.host_gw.ipv4"].Baseline, 1e-9)
	require.InDelta(t, 0.119, byName["migration.cutover_ms.p99.host_gw.ipv4"].Ratio, 1e-9)
	require.InDelta(t, 2, byName["migration.lost_pings.host_gw.ipv6"].Value, 1e-9)
	require.InDelta(t, 1.048, byName["migration.cutover_ms.p99.bgp.ipv4"].Ratio, 1e-9)
	require.InDelta(t, 0.96, byName["migration.lost_pings.bgp.ipv4"].Ratio, 1e-9)
	require.Equal(t, "migration.txt: BenchmarkMigration/routing=bgp", byName["migration.lost_pings.bgp.ipv4"].Source)
	require.Contains(t, BaselineOf("migration.cutover_ms.p99.vxlan.ipv6"), "goal: at most 250 ms")
	require.Contains(t, missing, "migration.cutover_ms.p99.vxlan.ipv4", "vxlan did not run")
	require.Contains(t, missing, "migration.cutover_ms.p99.bgp.ipv6", "a metric the line lacks")
}

func keys(m map[string]any) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

// figuresFrom is the report's figures by name, and the names missing,
// from go test -bench output by output file name.
func figuresFrom(t *testing.T, outs map[string]string) (map[string]Figure, []string) {
	t.Helper()
	results := map[string][]Result{}
	for file, out := range outs {
		rs, err := Parse(strings.NewReader(out))
		require.NoError(t, err)
		results[file] = rs
	}
	figs, missing := Figures(results)
	return byNameOf(figs), missing
}

func byNameOf(figs []Figure) map[string]Figure {
	byName := map[string]Figure{}
	for _, f := range figs {
		byName[f.Name] = f
	}
	return byName
}
