package benchreport

import (
	"fmt"
	"math"
	"sort"
	"strings"
)

// Figure is one named figure of the report, beside its baseline from the
// same run.
type Figure struct {
	Name     string  `json:"name"`
	Value    float64 `json:"value"`
	Baseline float64 `json:"baseline"`
	Ratio    float64 `json:"ratio"`
	Unit     string  `json:"unit"`
	// Source is the file and benchmark it came from.
	Source string `json:"source"`
}

// spec says where a figure comes from: a benchmark of one output file,
// the metric that is its value, and the metric that is its baseline (of
// baselineBench's line when set, else of the same line), or, when only a
// ratio is reported, the ratio's.
type spec struct {
	name, file, bench   string
	value, baseline     string
	baselineBench       string
	ratio               string // used when baseline is empty
	unit, baselineLabel string
}

// The scale figures come from the runs on the 3-member cluster.
const (
	stormBench = "BenchmarkClaimStorm/etcd=cluster3"
	// costBench sends a storm's transactions one kind at a time, through
	// the node's store without an allocator (BenchmarkClaimCost).
	costBench   = "BenchmarkClaimCost/etcd=cluster3"
	steadyBench = "BenchmarkSteady/etcd=cluster3"
)

// The Kubernetes bursts: one kubelet, pods created at once
// (e2e/k8s BenchmarkK8sBurst).
const (
	k8sBurst100 = "BenchmarkK8sBurst/burst=100"
	k8sBurst30  = "BenchmarkK8sBurst/burst=30"
	// k8sBridge is their baseline: the chain kvipam's conflist has, with
	// bridge and host-local in kvipam's place.
	k8sBridge = "bridge + host-local + portmap"
)

// specs are the figures the report names (issue 20 and the pools issue's
// tight-pool figures).
var specs = append([]spec{
	{name: "cni.add.p50.default_vs_bridge", file: "adddel", bench: "BenchmarkAddDel/concurrency=1", value: "kvipam-add-p50-ms", baseline: "bridge-add-p50-ms", unit: "ms", baselineLabel: "bridge + host-local"},
	{name: "cni.del.p50.default_vs_bridge", file: "adddel", bench: "BenchmarkAddDel/concurrency=1", value: "kvipam-del-p50-ms", baseline: "bridge-del-p50-ms", unit: "ms", baselineLabel: "bridge + host-local"},
	{name: "cni.add.p50.c50.default_vs_bridge", file: "adddel", bench: "BenchmarkAddDel/concurrency=50", value: "kvipam-add-p50-ms", baseline: "bridge-add-p50-ms", unit: "ms", baselineLabel: "bridge + host-local"},
	{name: "cni.add.p50.bpf_vs_routes", file: "datapath", bench: "BenchmarkAddDatapath", value: "bpf-add-p50-ms", baseline: "routes-add-p50-ms", unit: "ms", baselineLabel: "routes datapath"},
	{name: "cni.add.p50.bpf_vs_routes.loaded", file: "datapath-loaded", bench: "BenchmarkAddDatapathLoaded", value: "bpf-add-p50-ms", baseline: "routes-add-p50-ms", unit: "ms", baselineLabel: "routes datapath, CPU hog and 100 pods attached"},
	{name: "cni.add.p50.bpf_tcx_vs_routes.loaded", file: "datapath-loaded", bench: "BenchmarkAddDatapathLoaded", value: "bpf-tcx-add-p50-ms", baseline: "routes-add-p50-ms", unit: "ms", baselineLabel: "routes datapath, CPU hog and 100 pods attached"},
	{name: "cni.add.p50.bpf_tcx_vs_routes", file: "datapath", bench: "BenchmarkAddDatapath", value: "bpf-tcx-add-p50-ms", baseline: "routes-add-p50-ms", unit: "ms", baselineLabel: "routes datapath"},
	{name: "hostport.add_p50.bpf_vs_portmap", file: "hostport", bench: "BenchmarkHostPortAdd", value: "bpf-add-p50-ms", baseline: "portmap-add-p50-ms", unit: "ms", baselineLabel: "a chained portmap (iptables); two host ports (TCP, UDP) a pod, one pod at a time"},
	{name: "hostport.cpu_per_pod.bpf_vs_portmap", file: "hostport", bench: "BenchmarkHostPortAdd", value: "bpf-cpu-ms/pod", baseline: "portmap-cpu-ms/pod", unit: "ms", baselineLabel: "a chained portmap (iptables); ADD and DEL, the plugins' and the agent's CPU"},
	{name: "hostport.mapping_cpu_per_pod.bpf", file: "hostport", bench: "BenchmarkHostPortAdd", value: "bpf-mapping-cpu-ms/pod", unit: "ms"},
	{name: "hostport.mapping_cpu_per_pod.portmap", file: "hostport", bench: "BenchmarkHostPortAdd", value: "portmap-mapping-cpu-ms/pod", unit: "ms"},
	{name: "burst100.above_floor.kvipam_vs_bridge", file: "burst", bench: "BenchmarkBurst100", value: "kvipam-above-floor-ms", baseline: "bridge-above-floor-ms", unit: "ms", baselineLabel: "bridge + host-local"},
	{name: "burst100.add_p99.kvipam_vs_bridge", file: "burst", bench: "BenchmarkBurst100", value: "kvipam-add-p99-ms", baseline: "bridge-add-p99-ms", unit: "ms", baselineLabel: "bridge + host-local"},
	{name: "burst100.rtnl_wait_per_add.kvipam_vs_bridge", file: "burst-locks", bench: "BenchmarkBurst100", value: "kvipam-rtnl-wait-ms", baseline: "bridge-rtnl-wait-ms", unit: "ms", baselineLabel: "bridge + host-local; a traced burst (KVIPAM_LOCK_TRACE=1)"},
	{name: "burst100.rtnl_queue_pct.kvipam_vs_bridge", file: "burst-locks", bench: "BenchmarkBurst100", value: "kvipam-rtnl-queue-pct", baseline: "bridge-rtnl-queue-pct", unit: "%", baselineLabel: "bridge + host-local; share of the burst rtnl had a queue"},
	{name: "k8s.burst100.ready_p50.kvipam_vs_bridge", file: "k8s", bench: k8sBurst100, value: "kvipam-ready-p50-ms", baseline: "bridge-ready-p50-ms", unit: "ms", baselineLabel: k8sBridge + ", dual-stack like kvipam; pod creation to Ready, one kubelet"},
	{name: "k8s.burst100.ready_p99.kvipam_vs_bridge", file: "k8s", bench: k8sBurst100, value: "kvipam-ready-p99-ms", baseline: "bridge-ready-p99-ms", unit: "ms", baselineLabel: k8sBridge + ", dual-stack like kvipam; pod creation to Ready, one kubelet"},
	{name: "k8s.burst100.above_floor.kvipam_vs_bridge", file: "k8s", bench: k8sBurst100, value: "kvipam-above-floor-ms", baseline: "bridge-above-floor-ms", unit: "ms", baselineLabel: k8sBridge + "; all pods Ready, less host-network pods'; goal: ratio at most 0.5"},
	{name: "k8s.burst100.cpu_above_floor.kvipam_vs_bridge", file: "k8s", bench: k8sBurst100, value: "kvipam-cpu-above-floor-ms-per-pod", baseline: "bridge-cpu-above-floor-ms-per-pod", unit: "ms", baselineLabel: k8sBridge + "; the machine's CPU a pod costs in a burst, every program's, less a host-network pod's"},
	{name: "k8s.burst100.cpu_above_floor.routes_vs_bridge", file: "k8s", bench: k8sBurst100, value: "kvipam-routes-cpu-above-floor-ms-per-pod", baseline: "bridge-cpu-above-floor-ms-per-pod", unit: "ms", baselineLabel: k8sBridge + "; kvipam on the routes datapath, CPU a pod less a host-network pod's"},
	{name: "k8s.burst100.netsetup_p50_ms", file: "k8s", bench: k8sBurst100, value: "kvipam-sandbox-p50-ms", baseline: "bridge-sandbox-p50-ms", unit: "ms", baselineLabel: k8sBridge + "; containerd's RunPodSandbox, the CNI ADD inside"},
	{name: "k8s.burst100.cni_add_p50_ms", file: "k8s", bench: k8sBurst100, value: "kvipam-cni-add-p50-ms", baseline: "bridge-cni-add-p50-ms", unit: "ms", baselineLabel: k8sBridge + "; a sandbox's plugin execs, first fork to last exit"},
	{name: "k8s.burst100.plugin_exec_p50_ms", file: "k8s", bench: k8sBurst100, value: "kvipam-exec-kvipam-p50-ms", baseline: "bridge-exec-bridge-p50-ms", unit: "ms", baselineLabel: "the bridge plugin's exec (host-local's inside); kvipam's, fork to exit"},
	{name: "k8s.burst100.ready_p50.routes_vs_bridge", file: "k8s", bench: k8sBurst100, value: "kvipam-routes-ready-p50-ms", baseline: "bridge-ready-p50-ms", unit: "ms", baselineLabel: k8sBridge + "; kvipam on the routes datapath"},
	{name: "k8s.burst100.above_floor.routes_vs_bridge", file: "k8s", bench: k8sBurst100, value: "kvipam-routes-above-floor-ms", baseline: "bridge-above-floor-ms", unit: "ms", baselineLabel: k8sBridge + "; kvipam on the routes datapath, all pods Ready, less host-network pods'"},
	{name: "k8s.burst100.hostnet_ready_p50_ms", file: "k8s", bench: k8sBurst100, value: "hostnet-ready-p50-ms", baseline: "bridge-ready-p50-ms", unit: "ms", baselineLabel: k8sBridge + "; host-network pods are the floor"},
	{name: "k8s.burst30.ready_p50.kvipam_vs_bridge", file: "k8s", bench: k8sBurst30, value: "kvipam-ready-p50-ms", baseline: "bridge-ready-p50-ms", unit: "ms", baselineLabel: k8sBridge + ", dual-stack like kvipam; pod creation to Ready, one kubelet"},
	{name: "k8s.burst30.ready_p99.kvipam_vs_bridge", file: "k8s", bench: k8sBurst30, value: "kvipam-ready-p99-ms", baseline: "bridge-ready-p99-ms", unit: "ms", baselineLabel: k8sBridge + ", dual-stack like kvipam; pod creation to Ready, one kubelet"},
	{name: "k8s.burst30.above_floor.kvipam_vs_bridge", file: "k8s", bench: k8sBurst30, value: "kvipam-above-floor-ms", baseline: "bridge-above-floor-ms", unit: "ms", baselineLabel: k8sBridge + "; all pods Ready, less host-network pods'"},
	{name: "k8s.burst30.netsetup_p50_ms", file: "k8s", bench: k8sBurst30, value: "kvipam-sandbox-p50-ms", baseline: "bridge-sandbox-p50-ms", unit: "ms", baselineLabel: k8sBridge + "; containerd's RunPodSandbox, the CNI ADD inside"},
	{name: "k8s.single.netsetup_ms", file: "k8s", bench: k8sBurst100, value: "kvipam-single-cni-add-p50-ms", baseline: "bridge-single-cni-add-p50-ms", unit: "ms", baselineLabel: k8sBridge + "; one pod at a time, RunPodSandbox's network part: the chain's execs, first fork to last exit; goal: ratio below 1"},
	{name: "k8s.single.sandbox_ms", file: "k8s", bench: k8sBurst100, value: "kvipam-single-sandbox-p50-ms", baseline: "bridge-single-sandbox-p50-ms", unit: "ms", baselineLabel: k8sBridge + "; one pod at a time, containerd's whole RunPodSandbox"},
	{name: "k8s.single.plugin_exec_ms", file: "k8s", bench: k8sBurst100, value: "kvipam-single-exec-kvipam-p50-ms", baseline: "bridge-single-exec-bridge-p50-ms", unit: "ms", baselineLabel: "the bridge plugin's exec (host-local's inside), one pod at a time; kvipam's, fork to exit"},
	{name: "restart.10k.seconds", file: "restart", bench: "BenchmarkAgentRestart", value: "s/restart-10k", baseline: "s/restart-empty", unit: "s", baselineLabel: "the same agent on an empty node"},
	{name: "agent.rss.idle_mb", file: "restart", bench: "BenchmarkAgentRestart", value: "MB/rss-idle", unit: "MB"},
	{name: "agent.rss.10k_mb", file: "restart", bench: "BenchmarkAgentRestart", value: "MB/rss-10k", baseline: "MB/rss-idle", unit: "MB", baselineLabel: "the same agent idle, on an empty node"},
	{name: "scale.claim5000.seconds", file: "storm", bench: stormBench, value: "s/storm", baseline: "s/baseline", unit: "s", baselineLabel: "as many bare create-if-absent transactions at once, 3 members"},
	{name: "scale.claim5000.failures", file: "storm", bench: stormBench, value: "failures", unit: "count"},
	{name: "scale.claim5000.try_again", file: "storm", bench: stormBench, value: "try-again", unit: "count"},
	{name: "scale.claim5000.lost_leases", file: "storm", bench: stormBench, value: "lost-leases", unit: "count"},
	{name: "scale.claim5000.conflicts", file: "storm", bench: stormBench, value: "conflicts", unit: "count"},
	{name: "scale.claim5000.duplicates", file: "storm", bench: stormBench, value: "duplicates", unit: "count"},
	{name: "scale.claim5000.vs_raw", file: "storm", bench: stormBench, value: "s/storm", baseline: "s/baseline", unit: "s", baselineLabel: "as many bare create-if-absent transactions at once, same run; goal: ratio at most 2"},
	{name: "scale.claim5000.first_ms", file: "storm", bench: stormBench, value: "first-end-ms", baseline: "baseline-first-end-ms", unit: "ms", baselineLabel: "the first bare transaction's end, same run"},
	{name: "scale.claim5000.etcd_rss_mb", file: "storm", bench: stormBench, value: "etcd-rss-mb", unit: "MB"},
	{name: "scale.claim5000.txn.claim_first_vs_bare", file: "claimcost", bench: costBench, value: "s/claim-first", baseline: "s/bare", unit: "s", baselineLabel: "as many bare create-if-absent transactions at once; a storm node's winning claim (claim, home, first address) through its store, no allocator"},
	{name: "scale.claim5000.txn.lost_vs_bare", file: "claimcost", bench: costBench, value: "s/lost", baseline: "s/bare", unit: "s", baselineLabel: "as many bare create-if-absent transactions at once; a storm node's lost claim through its store, no allocator"},
	{name: "scale.claim5000.txn.claim_vs_bare", file: "claimcost", bench: costBench, value: "s/claim", baseline: "s/bare", unit: "s", baselineLabel: "as many bare create-if-absent transactions at once; a claim and home with no first address, through the store"},
	{name: "scale.claim10000.seconds", file: "storm10k", bench: stormBench, value: "s/storm", baseline: "s/baseline", unit: "s", baselineLabel: "as many bare create-if-absent transactions at once, 3 members"},
	{name: "scale.claim10000.try_again", file: "storm10k", bench: stormBench, value: "try-again", unit: "count"},
	{name: "scale.claim10000.failures", file: "storm10k", bench: stormBench, value: "failures", unit: "count"},
	{name: "scale.claim10000.lost_leases", file: "storm10k", bench: stormBench, value: "lost-leases", unit: "count"},
	{name: "scale.claim10000.duplicates", file: "storm10k", bench: stormBench, value: "duplicates", unit: "count"},
	{name: "scale.claim10000.etcd_rss_mb", file: "storm10k", bench: stormBench, value: "etcd-rss-mb", unit: "MB"},
	{name: "scale.claim10000.claims_left", file: "storm10k", bench: stormBench, value: "claims-left", unit: "count"},
	{name: "scale.claim10000.vs_raw", file: "storm10k", bench: stormBench, value: "s/storm", baseline: "s/baseline", unit: "s", baselineLabel: "as many bare create-if-absent transactions at once, the mean of one run before the storm and one after; each node's Allocate under the agent's 5 s request timeout"},
	{name: "scale.claim5000.claims_left", file: "storm", bench: stormBench, value: "claims-left", unit: "count"},
	{name: "scale.claim5000.baseline_after_vs_before", file: "storm", bench: stormBench, value: "s/baseline-after", baseline: "s/baseline-before", unit: "s", baselineLabel: "the bare transactions before the storm; after it, on the store the storm left"},
	{name: "scale.max_rate_p99_50ms.vs_raw", file: "steady", bench: steadyBench, value: "max-rate-under-50ms", baseline: "raw-max-rate-under-50ms", unit: "allocations/s", baselineLabel: "the highest rate of the sweep at which bare create-if-absent transactions hold p99 under 50 ms, same run, interleaved; goal: ratio 1"},
	{name: "scale.release_max_rate_p99_50ms.vs_raw", file: "steady", bench: steadyBench, value: "release-max-rate-under-50ms", baseline: "rawdel-max-rate-under-50ms", unit: "releases/s", baselineLabel: "the highest rate of the sweep at which bare deletes guarded by revision hold p99 under 50 ms, same run, interleaved"},
	{name: "scale.rate_sweep.p99_vs_raw.max", file: "steady", bench: steadyBench, value: "p99-vs-raw-max", unit: "ratio", ratio: "p99-vs-raw-max", baselineLabel: "the largest ratio of allocation (or release) p99 to the bare transactions' (creates, or deletes) at one rate, over the rates where bare creates hold p99 under 50 ms; goal: at most 1.2"},
	{name: "scale.rate_sweep.alloc_p99_vs_raw.max", file: "steady", bench: steadyBench, value: "alloc-p99-vs-raw-max", unit: "ratio", ratio: "alloc-p99-vs-raw-max", baselineLabel: "as rate_sweep.p99_vs_raw.max, allocations against bare creates only"},
	{name: "scale.rate_sweep.release_p99_vs_raw.max", file: "steady", bench: steadyBench, value: "release-p99-vs-raw-max", unit: "ratio", ratio: "release-p99-vs-raw-max", baselineLabel: "as rate_sweep.p99_vs_raw.max, releases against bare deletes only"},
	{name: "scale.fill150k.last_vs_first", file: "steady", bench: steadyBench, value: "s/last-group", baseline: "s/first-group", unit: "s", baselineLabel: "the first 1,000 nodes"},
	{name: "scale.fill150k.raw_last_vs_first", file: "steady", bench: steadyBench, value: "s/last-raw-group", baseline: "s/first-raw-group", unit: "s", baselineLabel: "bare transactions in the same shape, after the first 1,000 nodes"},
	{name: "scale.fill150k.etcd_cpu_last_vs_first", file: "steady", bench: steadyBench, value: "etcd-cpu-s/last-group", baseline: "etcd-cpu-s/first-group", unit: "s", baselineLabel: "the etcd members' CPU in the first 1,000 nodes"},
	{name: "scale.fill150k.process_cpu_last_vs_first", file: "steady", bench: steadyBench, value: "process-cpu-s/last-group", baseline: "process-cpu-s/first-group", unit: "s", baselineLabel: "the fleet process's CPU in the first 1,000 nodes"},
	{name: "scale.150k.alloc_p99_ms", file: "steady", bench: steadyBench, value: "alloc-p99-ms", baseline: "raw-p99-ms", unit: "ms", baselineLabel: "raw create-if-absent p99, same rate, same cluster"},
	{name: "scale.150k.alloc_p99_vs_raw", file: "steady", bench: steadyBench, value: "alloc-p99-ms", baseline: "raw-p99-ms", unit: "ms", baselineLabel: "raw create-if-absent p99, same rate, same cluster"},
	{name: "scale.150k.alloc_p50_ms", file: "steady", bench: steadyBench, value: "alloc-p50-ms", baseline: "raw-p50-ms", unit: "ms", baselineLabel: "raw create-if-absent p50"},
	{name: "scale.150k.max_rate", file: "steady", bench: steadyBench, value: "max-rate-under-50ms", unit: "allocations/s"},
	{name: "scale.150k.db_size_mb", file: "steady", bench: steadyBench, value: "db-in-use-mb", unit: "MB"},
	{name: "scale.150k.restart_ms", file: "steady", bench: steadyBench, value: "restart-ms", unit: "ms"},
	{name: "scale.150k.duplicates", file: "steady", bench: steadyBench, value: "duplicates", unit: "count"},
	{name: "scale.choose_block.slash8_vs_slash20", file: "choose", bench: "BenchmarkChooseBlock", value: "x-/20-on-/8", unit: "ratio", ratio: "x-/20-on-/8"},
	{name: "bpf.attach_detach.tcx_vs_clsact", file: "attach", bench: "BenchmarkAttachDetach/tcx", value: "ns/op", baseline: "ns/op", baselineBench: "BenchmarkAttachDetach/clsact", unit: "ns", baselineLabel: "clsact"},
	{name: "tight1000.create.vs_roomy", file: "tight", bench: "BenchmarkTightPool", value: "tight1000.create.seconds", ratio: "tight1000.create.vs-roomy", unit: "s", baselineLabel: "a roomy pool"},
	{name: "tight1000.recreate.vs_roomy", file: "tight", bench: "BenchmarkTightPool", value: "tight1000.recreate.seconds", ratio: "tight1000.recreate.vs-roomy", unit: "s", baselineLabel: "a roomy pool"},
	{name: "tight1000.recovery.vs_roomy", file: "tight", bench: "BenchmarkTightPool", value: "tight1000.recovery.seconds", ratio: "tight1000.recovery.vs-roomy", unit: "s", baselineLabel: "a roomy pool"},
	{name: "tight1000.delete.vs_roomy", file: "tight", bench: "BenchmarkTightPool", value: "tight1000.delete.seconds", ratio: "tight1000.delete.vs-roomy", unit: "s", baselineLabel: "a roomy pool"},
	{name: "tight1000.failures", file: "tight", bench: "BenchmarkTightPool", value: "tight1000.failures", unit: "count"},
}, append(append(k8sNetSpecs(), churnSpecs()...), migrationSpecs()...)...)

// k8sNetSpecs are the network's own CPU per pod in the 100-pod burst
// (issue 49): kvipam's chain as it ships for the eBPF datapath (no
// portmap) against bridge+host-local+portmap, and each program's share.
func k8sNetSpecs() []spec {
	const label = k8sBridge + " with portmap's iptables; every plugin exec of the chain and what it ran, the agent; ms of CPU a pod in the burst"
	out := []spec{
		{name: "k8s.burst100.net_cpu_per_pod.kvipam_vs_bridge", file: "k8s", bench: k8sBurst100, value: "kvipam-net-cpu-ms-per-pod", baseline: "bridge-net-cpu-ms-per-pod", unit: "ms", baselineLabel: label + "; goal: ratio at most 0.4"},
		{name: "k8s.burst100.net_cpu_per_pod.routes_vs_bridge", file: "k8s", bench: k8sBurst100, value: "kvipam-routes-net-cpu-ms-per-pod", baseline: "bridge-net-cpu-ms-per-pod", unit: "ms", baselineLabel: label + "; kvipam on the routes datapath, portmap chained"},
		{name: "k8s.burst100.loadavg", file: "k8s", bench: k8sBurst100, value: "kvipam-loadavg", baseline: "bridge-loadavg", unit: "load", baselineLabel: "the machine's 1-minute load average at the end of bridge's bursts; kvipam's at the end of its own"},
	}
	progs := []struct{ net, name, prog string }{
		{"kvipam", "plugin", "kvipam"}, {"kvipam", "agent", "kvipam-agent"},
		{"bridge", "bridge", "bridge"}, {"bridge", "host_local", "host-local"}, {"bridge", "portmap", "portmap"},
		{"bridge", "iptables", "iptables"},
	}
	for _, p := range progs {
		out = append(out, spec{name: "k8s.burst100.net_cpu_per_pod." + p.net + "." + p.name, file: "k8s", bench: k8sBurst100, value: p.net + "-net-cpu-" + p.prog + "-ms-per-pod", unit: "ms"})
	}
	return out
}

// churnSpecs are the churn's figures (e2e/k8s BenchmarkK8sChurn): 10 pods
// created and 10 deleted a second on one node, and the rate each network
// holds with ADD p99 under 1 s.
func churnSpecs() []spec {
	const rate10, ceiling = "BenchmarkK8sChurn/rate=10", "BenchmarkK8sChurn/ceiling"
	const label = k8sBridge + " under the same churn"
	return []spec{
		{name: "node.churn10.add_p99_ms", file: "k8s", bench: rate10, value: "kvipam-add-p99-ms", baseline: "bridge-add-p99-ms", unit: "ms", baselineLabel: label + "; each sandbox's CNI ADD, first fork to last exit; goal: kvipam's at most 500 ms"},
		{name: "node.churn10.add_p50_ms", file: "k8s", bench: rate10, value: "kvipam-add-p50-ms", baseline: "bridge-add-p50-ms", unit: "ms", baselineLabel: label},
		{name: "node.churn10.failed_sandboxes", file: "k8s", bench: rate10, value: "kvipam-failed-sandboxes", baseline: "bridge-failed-sandboxes", unit: "count", baselineLabel: label + "; goal: 0"},
		{name: "node.churn10.leaks", file: "k8s", bench: rate10, value: "kvipam-leaks", baseline: "bridge-leaks", unit: "count", baselineLabel: label + "; addresses held after every pod is gone (kvipam: records, kvipamctl check; bridge: host-local's files); goal: 0"},
		{name: "node.churn10.agent_rss_last_vs_first", file: "k8s", bench: rate10, value: "kvipam-rss-last-x-first", unit: "ratio"},
		{name: "node.churn10.loadavg", file: "k8s", bench: rate10, value: "kvipam-loadavg", baseline: "bridge-loadavg", unit: "load", baselineLabel: "the 1-minute load average at the end of bridge's churn; kvipam's at the end of its own"},
		{name: "node.churn.ceiling_per_s", file: "k8s", bench: ceiling, value: "kvipam-ceiling-per-s", baseline: "bridge-ceiling-per-s", unit: "pods/s", baselineLabel: k8sBridge + "; the highest rate of the sweep whose ADD p99 stayed under 1 s"},
	}
}

// migrationSpecs are live migration's figures (e2e BenchmarkMigration,
// output file migration.txt), per routing and family: the cut-over time
// p99 and the most pings a move lost, each beside the goal.
func migrationSpecs() []spec {
	var out []spec
	for _, routing := range []string{"host-gw", "vxlan", "bgp"} {
		bench := "BenchmarkMigration/routing=" + routing
		name := strings.ReplaceAll(routing, "-", "_")
		for _, fam := range []string{"ipv4", "ipv6"} {
			out = append(out,
				spec{name: "migration.cutover_ms.p99." + name + "." + fam, file: "migration", bench: bench, value: fam + "-cutover-p99-ms", baseline: "goal-cutover-ms", unit: "ms",
					baselineLabel: "goal: at most 250 ms; from the guest's announcement in the target pod (the source's interface down at the same instant) until every node's kernel (and the router's, from FRR) routes the VM's address to the target"},
				spec{name: "migration.lost_pings." + name + "." + fam, file: "migration", bench: bench, value: fam + "-lost-pings-max", baseline: "goal-lost-pings", unit: "count",
					baselineLabel: "goal: at most 25; the most pings (10 ms apart, from a third node) a move lost, its ADD and DEL included"})
		}
	}
	return out
}

// NotMeasured are figures the report names but no benchmark measures yet.
var NotMeasured []string

// Figures picks the named figures out of the results, by output file
// name (without extension). A figure whose file or metric is missing is
// left out, and named in missing.
func Figures(byFile map[string][]Result) (figs []Figure, missing []string) {
	for _, s := range specs {
		f, ok := s.figure(byFile)
		if !ok {
			missing = append(missing, s.name)
			continue
		}
		figs = append(figs, f)
	}
	sort.SliceStable(figs, func(i, j int) bool { return figs[i].Name < figs[j].Name })
	return figs, missing
}

func (s spec) figure(byFile map[string][]Result) (Figure, bool) {
	res, ok := find(byFile[s.file], s.bench)
	if !ok {
		return Figure{}, false
	}
	v, ok := res.Metrics[s.value]
	if !ok {
		return Figure{}, false
	}
	f := Figure{Name: s.name, Value: v, Unit: s.unit, Source: fmt.Sprintf("%s.txt: %s", s.file, s.bench)}
	switch {
	case s.baseline != "":
		base := res
		if s.baselineBench != "" {
			if base, ok = find(byFile[s.file], s.baselineBench); !ok {
				return Figure{}, false
			}
		}
		f.Baseline = base.Metrics[s.baseline]
	case s.ratio != "":
		if r := res.Metrics[s.ratio]; r > 0 {
			f.Baseline = v / r
		}
	}
	if f.Baseline > 0 {
		f.Ratio = round(f.Value / f.Baseline)
	}
	return f, true
}

func find(rs []Result, name string) (Result, bool) {
	for i := len(rs) - 1; i >= 0; i-- { // the last run of a name wins
		if rs[i].Name == name {
			return rs[i], true
		}
	}
	return Result{}, false
}

func round(x float64) float64 { return math.Round(x*1000) / 1000 }

// BaselineOf says what a figure's baseline is, for the report's table.
func BaselineOf(name string) string {
	for _, s := range specs {
		if s.name == name {
			return s.baselineLabel
		}
	}
	return ""
}
