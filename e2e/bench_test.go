package e2e

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/internal/testsupport/nstest"
	"github.com/kvipam/kvipam/internal/tools/benchreport"
)

// BenchmarkAddDel measures ADD and DEL latency through libcni, as a
// runtime sees it (plugin processes included), for kvipam (veth, agent
// reservation, endpoint create) and for the reference bridge + host-local,
// in the same run on the same node, with 1 and 50 pods set up at once.
// Each iteration is one pod's ADD then DEL; the b.N iterations of each
// plugin are spread over the concurrent workers. It reports p50 and p99
// in milliseconds and the kvipam/bridge ratios (below 1: kvipam faster).
//
//	go test -run '^$' -bench AddDel -benchtime 200x ./e2e/
func BenchmarkAddDel(b *testing.B) {
	n := newNode(b, "bench")
	n.startAgent(agentOpts{pools: []string{"default=10.1.0.0/16"}})
	kv := n.kvipamList("kv", "1.0.0", `,"logLevel":"off"`)
	br := bridgeList(b, n, "benchbr0")

	for _, c := range []int{1, 50} {
		b.Run(fmt.Sprintf("concurrency=%d", c), func(b *testing.B) {
			for _, l := range []*libcni.NetworkConfigList{kv, br} { // warm caches and the bridge
				runAddDel(b, n, l, c, c, "warm-"+l.Name)
			}
			b.ResetTimer()
			start := time.Now()
			kvAdd, kvDel := runAddDel(b, n, kv, c, b.N, "kv")
			kvWall, start := time.Since(start), time.Now()
			brAdd, brDel := runAddDel(b, n, br, c, b.N, "br")
			brWall := time.Since(start)
			b.StopTimer()
			writeSamples(b, benchreport.Samples{Datapath: datapathFlag(), Concurrency: c},
				map[string][]time.Duration{"kvipam-add": kvAdd, "kvipam-del": kvDel, "bridge-add": brAdd, "bridge-del": brDel},
				map[string]time.Duration{"kvipam": kvWall, "bridge": brWall})

			for _, m := range []struct {
				name string
				d    []time.Duration
			}{{"kvipam-add", kvAdd}, {"kvipam-del", kvDel}, {"bridge-add", brAdd}, {"bridge-del", brDel}} {
				b.ReportMetric(ms(pct(m.d, 50)), m.name+"-p50-ms")
				b.ReportMetric(ms(pct(m.d, 99)), m.name+"-p99-ms")
			}
			b.ReportMetric(ratio(kvAdd, brAdd, 50), "add-p50-ratio")
			b.ReportMetric(ratio(kvAdd, brAdd, 99), "add-p99-ratio")
			b.ReportMetric(ratio(kvDel, brDel, 50), "del-p50-ratio")
			b.ReportMetric(ratio(kvDel, brDel, 99), "del-p99-ratio")
		})
	}
}

// bridgeList is the reference network: bridge + host-local on n, with a
// gateway on the bridge named bridge.
func bridgeList(b *testing.B, n *node, bridge string) *libcni.NetworkConfigList {
	return conflist(b, fmt.Sprintf(`{"cniVersion":"1.0.0","name":"br","plugins":[{"type":"bridge","bridge":%q,
		"isGateway":true,"ipam":{"type":"host-local","ranges":[[{"subnet":"10.3.0.0/16"}]],"dataDir":%q}}]}`, bridge, n.dir+"/host-local"))
}

// runAddDel runs iterations of ADD then DEL on l, spread over workers
// concurrent workers, each sandbox in a fresh pod netns as a runtime's
// (made before and removed after the timed part), and returns every
// ADD's and every DEL's latency.
func runAddDel(b *testing.B, n *node, l *libcni.NetworkConfigList, workers, iterations int, tag string) (adds, dels []time.Duration) {
	b.Helper()
	sandboxes, releases := make([]*pod, iterations), make([]func(), iterations)
	paths := make([]string, iterations)
	for i := range sandboxes {
		nsn, release, err := nstest.NewEphemeralNS()
		require.NoError(b, err)
		b.Cleanup(release)
		sandboxes[i], releases[i], paths[i] = podIn(fmt.Sprintf("%s-%d", tag, i), nsn), release, nsn.Path()
	}
	workers = min(workers, iterations)
	var next atomic.Int64
	var mu sync.Mutex
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := next.Add(1)
				if i > int64(iterations) {
					return
				}
				rt := *sandboxes[i-1].rt
				var add, del time.Duration
				err := n.do(func() error {
					start := time.Now()
					if _, err := n.cni.AddNetworkList(context.Background(), l, &rt); err != nil {
						return fmt.Errorf("add %s: %w", rt.ContainerID, err)
					}
					add = time.Since(start)
					start = time.Now()
					if err := n.cni.DelNetworkList(context.Background(), l, &rt); err != nil {
						return fmt.Errorf("del %s: %w", rt.ContainerID, err)
					}
					del = time.Since(start)
					return nil
				})
				releases[i-1]() // as the runtime removes the sandbox's netns
				if err != nil {
					errs <- err
					return
				}
				mu.Lock()
				adds, dels = append(adds, add), append(dels, del)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(b, err, "on %s", l.Name)
	}
	awaitReaped(b, n) // kvipam's DELs finish in the background: part of its run
	// A sandbox's netns must not outlive it.
	for _, p := range paths {
		_, err := os.Stat(p)
		require.ErrorIs(b, err, os.ErrNotExist, "netns %s left behind", p)
	}
	return adds, dels
}

// awaitReaped waits until the agent of n has deleted the host veths its
// DELs retired, so that the next measurement does not meet their deletion
// (the kernel's unregistration holds rtnl).
func awaitReaped(b *testing.B, n *node) {
	b.Helper()
	h := nlHandle(b, n.host)
	require.Eventually(b, func() bool {
		links, err := h.LinkList()
		if err != nil {
			return false // a dump interrupted by changes meanwhile (ErrDumpInterrupted): read again
		}
		return !slices.ContainsFunc(links, func(l netlink.Link) bool { return l.Attrs().Group == api.ReapLinkGroup })
	}, 30*time.Second, 5*time.Millisecond, "retired veths still there")
}

// pct is the p-th percentile (nearest rank).
func pct(d []time.Duration, p int) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	i := (len(s)*p + 99) / 100
	return s[max(i-1, 0)]
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func ratio(a, b []time.Duration, p int) float64 {
	if pb := pct(b, p); pb > 0 {
		return float64(pct(a, p)) / float64(pb)
	}
	return 0
}

// BenchmarkAddDatapath compares ADD and DEL latency through libcni with
// the agent in routes mode and in bpf mode, attaching the anti-spoofing
// program before the ADD answers as the default does (--bpf-attach auto: a
// clsact filter for a pod without egress limits) and with TCX
// (--bpf-attach tcx); one node each, same run, the three configurations
// interleaved in rounds. Ratios are against routes.
//
//	go test -run '^$' -bench AddDatapath -benchtime 100x ./e2e/
func BenchmarkAddDatapath(b *testing.B) { addDatapath(b, 0) }

// BenchmarkAddDatapathLoaded is BenchmarkAddDatapath on a busy node,
// where the kernel's grace periods are slow: a CPU hog (a busy shell loop
// per CPU) runs beside it, and each node already has 100 pods attached.
//
//	go test -run '^$' -bench AddDatapathLoaded -benchtime 100x ./e2e/
func BenchmarkAddDatapathLoaded(b *testing.B) { addDatapath(b, 100) }

// cpuHog keeps every CPU busy until the benchmark ends.
func cpuHog(b *testing.B) {
	for range runtime.NumCPU() {
		cmd := exec.Command("sh", "-c", "while :; do :; done")
		require.NoError(b, cmd.Start())
		b.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	}
}

func addDatapath(b *testing.B, attached int) {
	requireBPF(b)
	configs := []struct{ name, datapath, attach string }{{"routes", "routes", ""}, {"bpf", "bpf", ""}, {"bpf-tcx", "bpf", "tcx"}}
	lists := map[string]*libcni.NetworkConfigList{}
	nodes := map[string]*node{}
	for _, c := range configs {
		n := newNode(b, "dp"+strings.ReplaceAll(c.name, "-", ""))
		o := agentOpts{pools: []string{"default=10.1.0.0/16"}, datapath: c.datapath}
		if c.attach != "" {
			o.extra = []string{"--bpf-attach", c.attach}
		}
		n.startAgent(o)
		nodes[c.name], lists[c.name] = n, n.kvipamList("kv", "1.0.0", `,"logLevel":"off"`)
	}
	for name, n := range nodes {
		runAddDel(b, n, lists[name], 1, 1, "warm")
		for i := range attached {
			n.mustAdd(lists[name], newPod(b, fmt.Sprintf("%s-bg%d", name, i)))
		}
	}
	if attached > 0 {
		cpuHog(b)
	}
	b.ResetTimer()
	adds, dels := map[string][]time.Duration{}, map[string][]time.Duration{}
	const rounds = 5
	for r := range rounds {
		for _, c := range configs {
			a, d := runAddDel(b, nodes[c.name], lists[c.name], 1, max(b.N/rounds, 1), fmt.Sprintf("%s%d", c.name, r))
			adds[c.name], dels[c.name] = append(adds[c.name], a...), append(dels[c.name], d...)
		}
	}
	b.StopTimer()
	series := map[string][]time.Duration{}
	for _, c := range configs {
		series[c.name+"-add"], series[c.name+"-del"] = adds[c.name], dels[c.name]
	}
	writeSamples(b, benchreport.Samples{Concurrency: 1}, series, nil)
	for _, c := range configs {
		b.ReportMetric(ms(pct(adds[c.name], 50)), c.name+"-add-p50-ms")
		b.ReportMetric(ms(pct(dels[c.name], 50)), c.name+"-del-p50-ms")
		b.ReportMetric(ms(pct(adds[c.name], 99)), c.name+"-add-p99-ms")
	}
	b.ReportMetric(ratio(adds["bpf"], adds["routes"], 50), "add-p50-bpf/routes")
	b.ReportMetric(ratio(dels["bpf"], dels["routes"], 50), "del-p50-bpf/routes")
	b.ReportMetric(ratio(adds["bpf-tcx"], adds["routes"], 50), "add-p50-bpftcx/routes")
	b.ReportMetric(ratio(dels["bpf-tcx"], dels["routes"], 50), "del-p50-bpftcx/routes")
}

// BenchmarkBurst100 adds 100 pods at once on one node and deletes them,
// for kvipam (the agent's default datapath for KVIPAM_E2E_DATAPATH),
// bridge + host-local, and the loopback plugin: the exec floor, what any
// plugin costs the runtime. The three are interleaved, once per
// iteration. It reports each burst's completion time, kvipam's and
// bridge's time above the floor and their ratio (below 1: kvipam
// faster), and the p99 of one ADD within a burst. With
// KVIPAM_LOCK_TRACE=1 it also says how long the ADDs waited for rtnl
// (burstLocks).
//
//	go test -run '^$' -bench Burst100 -benchtime 3x ./e2e/
func BenchmarkBurst100(b *testing.B) {
	const pods = 100
	n := newNode(b, "burst")
	n.startAgent(agentOpts{pools: []string{"default=10.1.0.0/16"}})
	lists := map[string]*libcni.NetworkConfigList{
		"kvipam": n.kvipamList("kv", "1.0.0", `,"logLevel":"off"`),
		"bridge": bridgeList(b, n, "burstbr0"),
		"floor":  conflist(b, `{"cniVersion":"1.0.0","name":"lo","plugins":[{"type":"loopback"}]}`),
	}
	locks := newBurstLocks(b)
	// burst returns the burst's completion time, each ADD's latency, and
	// each ADD's completion since the burst's start; traced, its mutex
	// waits are added to name's.
	burst := func(l *libcni.NetworkConfigList, tag, name string, traced bool) (time.Duration, []time.Duration, []time.Duration) {
		adds, done := make([]time.Duration, pods), make([]time.Duration, pods)
		// A fresh netns per sandbox, as a runtime's, removed at the end:
		// the kernel tears a netns down in the background, holding rtnl,
		// and a burst must not meet the last one's teardown.
		ps := make([]*pod, pods)
		for i := range ps {
			ps[i] = newPod(b, fmt.Sprintf("%s-%d", tag, i))
		}
		var began time.Time // set before start is closed
		start := make(chan struct{})
		var wg sync.WaitGroup
		errs := make(chan error, pods)
		for i, p := range ps {
			wg.Go(func() {
				rt := *p.rt
				rt.ContainerID = fmt.Sprintf("%s-%d", tag, i)
				<-start
				t0 := time.Now()
				err := n.do(func() error { _, err := n.cni.AddNetworkList(context.Background(), l, &rt); return err })
				adds[i], done[i] = time.Since(t0), time.Since(began)
				if err != nil {
					errs <- err
				}
			})
		}
		stopTrace := func() {}
		if traced {
			stopTrace = locks.start(name)
		}
		began = time.Now()
		close(start)
		wg.Wait()
		took := time.Since(began)
		stopTrace()
		close(errs)
		for err := range errs {
			b.Fatalf("ADD on %s: %v", l.Name, err)
		}
		for i, p := range ps { // DEL, not measured
			rt := *p.rt
			rt.ContainerID = fmt.Sprintf("%s-%d", tag, i)
			require.NoError(b, n.do(func() error { return n.cni.DelNetworkList(context.Background(), l, &rt) }))
		}
		awaitReaped(b, n)
		return took, adds, done
	}
	for name, l := range lists { // warm the bridge and the caches
		burst(l, "warm-"+name, name, false)
	}
	b.ResetTimer()
	total := map[string]time.Duration{}
	all, completed := map[string][]time.Duration{}, map[string][]time.Duration{}
	for i := range b.N {
		for _, name := range []string{"floor", "kvipam", "bridge"} {
			took, adds, done := burst(lists[name], fmt.Sprintf("%s%d", name, i), name, true)
			total[name] += took
			all[name], completed[name] = append(all[name], adds...), append(completed[name], done...)
		}
	}
	b.StopTimer()
	if !locks.on { // a traced burst's completions are not the plots'
		writeSamples(b, benchreport.Samples{Datapath: datapathFlag(), Runs: b.N}, completed, nil)
	}
	per := func(name string) float64 { return ms(total[name]) / float64(b.N) }
	for _, name := range []string{"floor", "kvipam", "bridge"} {
		b.ReportMetric(per(name), name+"-burst-ms")
		b.ReportMetric(ms(pct(all[name], 99)), name+"-add-p99-ms")
	}
	locks.report([]string{"floor", "kvipam", "bridge"}, b.N, pods)
	b.ReportMetric(per("kvipam")-per("floor"), "kvipam-above-floor-ms")
	b.ReportMetric(per("bridge")-per("floor"), "bridge-above-floor-ms")
	if d := per("bridge") - per("floor"); d > 0 {
		b.ReportMetric((per("kvipam")-per("floor"))/d, "above-floor-kvipam/bridge")
	}
}
