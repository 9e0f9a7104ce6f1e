package k8s

import (
	"encoding/json"
	"fmt"
	"maps"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// --- the burst's measures: percentiles, steps, the report ---

// netStats are one network's measures in one burst size, pooled over the
// rounds.
type netStats struct {
	ready   []float64 // each pod's create to Ready, ms
	last    []float64 // each burst's last pod's, ms
	sandbox []float64 // each RunPodSandbox, ms
	cni     []float64 // each sandbox's CNI ADD: its first plugin's fork to its last one's exit, ms
	rest    []float64 // each sandbox's RunPodSandbox less its CNI ADD, ms
	plugins map[string][]float64
	// Each pod's creation to its RunPodSandbox's request (API server,
	// scheduler, kubelet's pod worker), and its RunPodSandbox's answer to
	// its Ready (the container created and started, the status reported).
	toSandbox, afterSandbox []float64
	// The single pods, created one at a time before the burst.
	singleSandbox, singleCNI []float64
	singlePlugins            map[string][]float64
	unseen                   int // sandboxes whose CNI ADD the process events missed
	cpu                      cpuStats
	net                      netCPU    // the network's own programs' CPU in the bursts
	load                     []float64 // the machine's 1-minute load average at each burst's end
}

// steps splits each sandbox run into its CNI ADD (the execs the process
// events saw for its ID) and the rest, into st's burst or single series.
func (st *netStats) steps(runs []sandboxRun, w *procWatch, hostNet, single bool) {
	ids := map[string]bool{}
	for _, r := range runs {
		ids[r.id] = true
		if single {
			st.singleSandbox = append(st.singleSandbox, ms(r.took()))
		} else {
			st.sandbox = append(st.sandbox, ms(r.took()))
		}
	}
	if hostNet || w == nil {
		return
	}
	execs := w.execsOf("ADD", ids)
	for _, r := range runs {
		es := execs[r.id]
		if len(es) == 0 {
			st.unseen++
			continue
		}
		first, last := es[0].exec, es[0].exit
		for _, e := range es {
			at := e.fork
			if at.IsZero() {
				at = e.exec
			}
			if at.Before(first) {
				first = at
			}
			if e.exit.After(last) {
				last = e.exit
			}
			m := &st.plugins
			if single {
				m = &st.singlePlugins
			}
			if *m == nil {
				*m = map[string][]float64{}
			}
			(*m)[e.plugin] = append((*m)[e.plugin], ms(e.took()))
		}
		if single {
			st.singleCNI = append(st.singleCNI, ms(last.Sub(first)))
		} else {
			st.cni = append(st.cni, ms(last.Sub(first)))
			st.rest = append(st.rest, ms(r.took()-last.Sub(first)))
		}
	}
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// pct is the q-quantile of v (nearest rank); 0 when v is empty.
func pct(v []float64, q float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	slices.Sort(s)
	i := int(math.Ceil(q*float64(len(s)))) - 1
	return s[min(max(i, 0), len(s)-1)]
}

// reportBurst reports a burst size's metrics (per network: p50 and p99 of
// create to Ready, the last pod's, RunPodSandbox, its CNI ADD and the
// rest, each plugin's exec; the time above the host-network floor; the
// ratios to bridge), logs where the time goes, and writes the samples.
func (c *kcluster) reportBurst(b *testing.B, n, rounds int, stats map[string]*netStats) {
	b.Helper()
	floor := stats["hostnet"]
	for _, net := range burstNetworks {
		st := stats[net]
		b.ReportMetric(pct(st.ready, 0.5), net+"-ready-p50-ms")
		b.ReportMetric(pct(st.ready, 0.99), net+"-ready-p99-ms")
		b.ReportMetric(avg(st.last), net+"-all-ready-ms")
		b.ReportMetric(pct(st.sandbox, 0.5), net+"-sandbox-p50-ms")
		b.ReportMetric(pct(st.singleSandbox, 0.5), net+"-single-sandbox-p50-ms")
		b.ReportMetric(pct(st.toSandbox, 0.5), net+"-to-sandbox-p50-ms")
		b.ReportMetric(pct(st.afterSandbox, 0.5), net+"-after-sandbox-p50-ms")
		if net == "hostnet" {
			continue
		}
		b.ReportMetric(avg(st.last)-avg(floor.last), net+"-above-floor-ms")
		b.ReportMetric(pct(st.ready, 0.5)-pct(floor.ready, 0.5), net+"-above-floor-p50-ms")
		if len(st.cni) > 0 {
			b.ReportMetric(pct(st.cni, 0.5), net+"-cni-add-p50-ms")
			b.ReportMetric(pct(st.rest, 0.5), net+"-sandbox-rest-p50-ms")
		}
		if len(st.singleCNI) > 0 {
			b.ReportMetric(pct(st.singleCNI, 0.5), net+"-single-cni-add-p50-ms")
		}
		for _, p := range slices.Sorted(maps.Keys(st.plugins)) {
			b.ReportMetric(pct(st.plugins[p], 0.5), net+"-exec-"+p+"-p50-ms")
		}
		for _, p := range slices.Sorted(maps.Keys(st.singlePlugins)) {
			b.ReportMetric(pct(st.singlePlugins[p], 0.5), net+"-single-exec-"+p+"-p50-ms")
		}
		if st.unseen > 0 {
			b.Logf("%s: %d sandboxes' CNI ADD not seen by the process events", networkLabels[net], st.unseen)
		}
	}
	kv, br := stats["kvipam"], stats["bridge"]
	ratio := func(x, y float64) float64 {
		if y <= 0 {
			return 0
		}
		return x / y
	}
	aboveKV, aboveBR := avg(kv.last)-avg(floor.last), avg(br.last)-avg(floor.last)
	b.ReportMetric(ratio(pct(kv.ready, 0.5), pct(br.ready, 0.5)), "ready-p50-x-bridge")
	b.ReportMetric(ratio(pct(kv.ready, 0.99), pct(br.ready, 0.99)), "ready-p99-x-bridge")
	b.ReportMetric(ratio(aboveKV, aboveBR), "above-floor-x-bridge")
	// Each network's CPU per pod above the floor's, by program and summed.
	cpuAbove, cpuAboveSum := map[string]map[string]float64{}, map[string]float64{}
	if floor.cpu.bursts > 0 {
		for _, net := range burstNetworks {
			b.ReportMetric(stats[net].cpu.meanBusy().Seconds(), net+"-burst-cpu-s")
			if net != "hostnet" {
				cpuAbove[net], cpuAboveSum[net] = stats[net].cpu.aboveFloor(&floor.cpu, n)
				b.ReportMetric(cpuAboveSum[net], net+"-cpu-above-floor-ms-per-pod")
			}
		}
		b.ReportMetric(ratio(cpuAboveSum["kvipam"], cpuAboveSum["bridge"]), "cpu-above-floor-x-bridge")
	}
	// The network's own CPU per pod: the chain's processes and the agent.
	netSum, netBy := map[string]float64{}, map[string]map[string]float64{}
	for _, net := range burstNetworks {
		st := stats[net]
		b.ReportMetric(avg(st.load), net+"-loadavg")
		if net == "hostnet" || st.net.bursts == 0 {
			continue
		}
		netSum[net], netBy[net] = st.net.perPod(n)
		b.ReportMetric(netSum[net], net+"-net-cpu-ms-per-pod")
		for _, p := range sortedProgs(netBy[net]) {
			b.ReportMetric(netBy[net][p], net+"-net-cpu-"+p+"-ms-per-pod")
		}
	}
	b.ReportMetric(ratio(netSum["kvipam"], netSum["bridge"]), "net-cpu-x-bridge")
	b.ReportMetric(ratio(pct(kv.singleCNI, 0.5), pct(br.singleCNI, 0.5)), "single-netsetup-x-bridge")
	b.ReportMetric(0, "ns/op")

	// Where the time goes.
	var sb strings.Builder
	fmt.Fprintf(&sb, "%d pods on n1, %s interleaved; p50s in ms:\n", n, plural(rounds, "round"))
	fmt.Fprintf(&sb, "  (ready: create to Ready p50, p99; all: the last pod's, mean over rounds; to sb: create to RunPodSandbox's request;\n"+
		"   sandbox: RunPodSandbox = CNI ADD + rest; after: RunPodSandbox's answer to Ready; single, 1 CNI: one pod at a time; above: all less the floor's)\n")
	fmt.Fprintf(&sb, "  %-36s %8s %8s %8s %8s %8s %10s %8s %8s %8s %8s %8s\n", "network", "ready", "ready99", "all", "to sb", "sandbox", "CNI ADD", "rest", "after", "single", "1 CNI", "above")
	for _, net := range burstNetworks {
		st := stats[net]
		above := "-"
		if net != "hostnet" {
			above = fmt.Sprintf("%.0f", avg(st.last)-avg(floor.last))
		}
		fmt.Fprintf(&sb, "  %-36s %8.0f %8.0f %8.0f %8.0f %8.0f %10.0f %8.0f %8.0f %8.0f %8.0f %8s\n", networkLabels[net], pct(st.ready, 0.5), pct(st.ready, 0.99), avg(st.last),
			pct(st.toSandbox, 0.5), pct(st.sandbox, 0.5), pct(st.cni, 0.5), pct(st.rest, 0.5), pct(st.afterSandbox, 0.5), pct(st.singleSandbox, 0.5), pct(st.singleCNI, 0.5), above)
	}
	for _, net := range burstNetworks {
		st := stats[net]
		for _, set := range []struct {
			what string
			m    map[string][]float64
		}{{"in the burst", st.plugins}, {"one pod at a time", st.singlePlugins}} {
			if len(set.m) == 0 {
				continue
			}
			fmt.Fprintf(&sb, "  %s, each plugin exec (fork to exit) %s:", networkLabels[net], set.what)
			for _, p := range slices.Sorted(maps.Keys(set.m)) {
				fmt.Fprintf(&sb, " %s p50 %.1f ms p99 %.1f ms (%d);", p, pct(set.m[p], 0.5), pct(set.m[p], 0.99), len(set.m[p]))
			}
			sb.WriteString("\n")
		}
	}
	if floor.cpu.bursts > 0 {
		fmt.Fprintf(&sb, "  CPU in a burst: all CPUs busy (s, the mean over rounds), then by program in ms a pod (live processes' own time, exited tasks' from taskstats with their run-queue wait):\n")
		for _, net := range burstNetworks {
			st := stats[net]
			fmt.Fprintf(&sb, "  %-36s %6.2f s; %s\n", networkLabels[net], st.cpu.meanBusy().Seconds(), st.cpu.top(12, n))
		}
		for _, net := range burstNetworks {
			if net != "hostnet" {
				fmt.Fprintf(&sb, "  %-36s above the floor %+.1f ms a pod: %s\n", networkLabels[net], cpuAboveSum[net], describeAbove(cpuAbove[net]))
			}
		}
	}
	if len(netSum) > 0 {
		fmt.Fprintf(&sb, "  the network's own CPU in a burst, ms a pod (the chain's plugin execs and what they ran, loopback left out; the agent), the machine's load average at the bursts' ends:\n")
		for _, net := range burstNetworks {
			if _, ok := netSum[net]; ok {
				fmt.Fprintf(&sb, "  %-36s %6.2f ms: %s (load %.1f)\n", networkLabels[net], netSum[net], describeProgs(netBy[net]), avg(stats[net].load))
			}
		}
		fmt.Fprintf(&sb, "  kvipam vs bridge: the network's own CPU %.2f vs %.2f ms a pod, %.3fx (goal at most 0.4); a single sandbox's CNI ADD p50 %.1f vs %.1f ms, %.3fx (goal below 1)\n",
			netSum["kvipam"], netSum["bridge"], ratio(netSum["kvipam"], netSum["bridge"]), pct(kv.singleCNI, 0.5), pct(br.singleCNI, 0.5), ratio(pct(kv.singleCNI, 0.5), pct(br.singleCNI, 0.5)))
	}
	if len(kv.last) == len(floor.last) && len(br.last) == len(floor.last) && len(floor.last) > 1 {
		fmt.Fprintf(&sb, "  each round's last pod above the floor's, kvipam vs bridge:")
		for i := range floor.last {
			k, r := kv.last[i]-floor.last[i], br.last[i]-floor.last[i]
			fmt.Fprintf(&sb, " %.0f vs %.0f ms (%.2fx);", k, r, ratio(k, r))
		}
		sb.WriteString("\n")
	}
	fmt.Fprintf(&sb, "  kvipam vs bridge: ready p50 %.3fx, p99 %.3fx, all Ready above the host-network floor %.0f ms vs %.0f ms: %.3fx",
		ratio(pct(kv.ready, 0.5), pct(br.ready, 0.5)), ratio(pct(kv.ready, 0.99), pct(br.ready, 0.99)), aboveKV, aboveBR, ratio(aboveKV, aboveBR))
	b.Log(sb.String())

	if dir := os.Getenv("KVIPAM_BENCH_SAMPLES"); dir != "" {
		series := map[string][]float64{}
		for _, net := range burstNetworks {
			st := stats[net]
			series[net] = st.ready
			series[net+"-sandbox"] = st.sandbox
			if len(st.cni) > 0 {
				series[net+"-cni-add"] = st.cni
			}
		}
		require.NoError(b, writeSamples(dir, benchSamples{Bench: b.Name(), Runs: rounds, SeriesMS: series}))
	}
}

// benchSamples is a benchmark's raw samples as
// internal/tools/benchreport.Samples reads them (this module does not
// depend on kvipam's): BenchmarkK8sBurst/burst=N's series are, per
// network (kvipam, kvipam-routes, bridge, hostnet), each pod's create to
// Ready (NET), its RunPodSandbox (NET-sandbox) and CNI ADD (NET-cni-add),
// in ms, pooled over Runs rounds.
type benchSamples struct {
	Bench    string               `json:"bench"`
	Runs     int                  `json:"runs,omitempty"`
	SeriesMS map[string][]float64 `json:"series_ms"`
}

func writeSamples(dir string, s benchSamples) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	j, err := json.Marshal(s)
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, strings.ReplaceAll(s.Bench, "/", "_")+".json"), j, 0o644)
}

func plural(n int, what string) string {
	if n == 1 {
		return "1 " + what
	}
	return fmt.Sprintf("%d %ss", n, what)
}

func avg(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	var s float64
	for _, x := range v {
		s += x
	}
	return s / float64(len(v))
}
