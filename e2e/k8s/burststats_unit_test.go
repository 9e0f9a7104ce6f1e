package k8s

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestBurstStepsFromLogAndExecs: containerd's log lines (logrus, as 1.6
// writes them) give each sandbox's RunPodSandbox with its ID; the execs of
// that ID split it into the CNI ADD (first fork to last exit) and the
// rest, and each plugin's time; another namespace's sandbox and another
// sandbox's exec are not counted.
func TestBurstStepsFromLogAndExecs(t *testing.T) {
	c := &kcluster{dir: t.TempDir()}
	require.NoError(t, os.MkdirAll(filepath.Join(c.dir, "logs"), 0o755))
	id := "4f0a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8"
	log := `time="2026-11-26T22:00:00.100000000Z" level=info msg="RunPodSandbox for &PodSandboxMetadata{Name:burst-0,Uid:u0,Namespace:ns1,Attempt:0,}"
time="2026-11-26T22:00:00.150000000Z" level=info msg="RunPodSandbox for &PodSandboxMetadata{Name:burst-0,Uid:u9,Namespace:ns2,Attempt:0,}"
time="2026-11-26T22:00:00.400000000Z" level=info msg="RunPodSandbox for &PodSandboxMetadata{Name:burst-0,Uid:u0,Namespace:ns1,Attempt:0,} returns sandbox id \"` + id + `\""
`
	require.NoError(t, os.WriteFile(filepath.Join(c.dir, "logs", "n1-containerd.log"), []byte(log), 0o644))
	runs := c.sandboxRuns("ns1")
	require.Len(t, runs, 1)
	r := runs["burst-0"]
	require.Equal(t, id, r.id)
	require.Equal(t, 300*time.Millisecond, r.took())
	require.Empty(t, c.sandboxRuns("ns2"), "a sandbox not answered is left out")
	require.Zero(t, r.failed)

	// A sandbox that failed once and was asked for again: from the first
	// request to the answer, one failed attempt.
	retried := `time="2026-11-26T22:00:01.000000000Z" level=info msg="RunPodSandbox for &PodSandboxMetadata{Name:burst-1,Uid:u1,Namespace:ns3,Attempt:0,}"
time="2026-11-26T22:00:01.500000000Z" level=error msg="RunPodSandbox for &PodSandboxMetadata{Name:burst-1,Uid:u1,Namespace:ns3,Attempt:0,} failed, error" error="failed to setup network for sandbox"
time="2026-11-26T22:00:03.000000000Z" level=info msg="RunPodSandbox for &PodSandboxMetadata{Name:burst-1,Uid:u1,Namespace:ns3,Attempt:0,}"
time="2026-11-26T22:00:03.200000000Z" level=info msg="RunPodSandbox for &PodSandboxMetadata{Name:burst-1,Uid:u1,Namespace:ns3,Attempt:0,} returns sandbox id \"` + id + `\""
`
	require.NoError(t, os.WriteFile(filepath.Join(c.dir, "logs", "n1-containerd.log"), []byte(log+retried), 0o644))
	again := c.sandboxRuns("ns3")["burst-1"]
	require.Equal(t, 1, again.failed)
	require.Equal(t, 2200*time.Millisecond, again.took())

	at := func(ms int) time.Time { return r.start.Add(time.Duration(ms) * time.Millisecond) }
	w := &procWatch{done: []cniExec{
		{plugin: "loopback", command: "ADD", container: id, fork: at(100), exec: at(102), exit: at(110)},
		{plugin: "kvipam", command: "ADD", container: id, fork: at(101), exec: at(103), exit: at(150)},
		{plugin: "portmap", command: "ADD", container: id, fork: at(151), exec: at(152), exit: at(180)},
		{plugin: "kvipam", command: "ADD", container: "other", fork: at(0), exec: at(1), exit: at(290)},
		{plugin: "kvipam", command: "DEL", container: id, fork: at(200), exec: at(201), exit: at(290)},
	}}
	var st netStats
	st.steps([]sandboxRun{r}, w, false, false)
	require.Equal(t, []float64{300}, st.sandbox)
	require.Equal(t, []float64{80}, st.cni)
	require.Equal(t, []float64{220}, st.rest)
	require.Equal(t, map[string][]float64{"loopback": {10}, "kvipam": {49}, "portmap": {29}}, st.plugins)
	st.steps([]sandboxRun{r}, w, false, true)
	require.Equal(t, []float64{300}, st.singleSandbox)
	require.Equal(t, []float64{80}, st.singleCNI)
	require.Len(t, st.cni, 1, "a single pod's steps go to the single series")
	require.InDelta(t, 29, pct([]float64{10, 49, 29}, 0.5), 1e-9)
	require.InDelta(t, 49, pct([]float64{10, 49, 29}, 0.99), 1e-9)
	require.InDelta(t, 10, pct([]float64{10, 49, 29}, 0.01), 1e-9)
}

// TestAgentHistogramDelta: the agent's histograms between two scrapes:
// how many observations each had and their mean, in ms for seconds.
func TestAgentHistogramDelta(t *testing.T) {
	a := parseHistograms(`# TYPE kvipam_etcd_txn_duration_seconds histogram
kvipam_etcd_txn_duration_seconds_bucket{op="allocate",le="0.0001"} 0
kvipam_etcd_txn_duration_seconds_sum{op="allocate"} 0.5
kvipam_etcd_txn_duration_seconds_count{op="allocate"} 10
kvipam_allocation_batch_size_sum 10
kvipam_allocation_batch_size_count 10
go_gc_duration_seconds_sum 3
`)
	b := parseHistograms(`kvipam_etcd_txn_duration_seconds_sum{op="allocate"} 1.5
kvipam_etcd_txn_duration_seconds_count{op="allocate"} 30
kvipam_etcd_txn_duration_seconds_sum{op="confirm"} 0.2
kvipam_etcd_txn_duration_seconds_count{op="confirm"} 20
kvipam_allocation_batch_size_sum 50
kvipam_allocation_batch_size_count 20
`)
	require.Equal(t, histSum{0.5, 10}, a[`kvipam_etcd_txn_duration_seconds{op="allocate"}`])
	require.Equal(t, `kvipam_allocation_batch_size 10, mean 4.00; kvipam_etcd_txn_duration_seconds{op="allocate"} 20, mean 50.0 ms; kvipam_etcd_txn_duration_seconds{op="confirm"} 20, mean 10.0 ms`, histDelta(a, b))
	require.Empty(t, histDelta(nil, b))
}
