package k8s

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// --- the burst: the kubelet's view of ADD latency ---

// bridgeDaemonSet installs the bridge and host-local baseline the way
// kvipam is installed: a DaemonSet whose init container copies the plugins
// and the conflist into the node's CNI directories.
const bridgeDaemonSet = `apiVersion: apps/v1
kind: DaemonSet
metadata: {name: cni-bridge, namespace: kube-system}
spec:
  selector: {matchLabels: {app: cni-bridge}}
  template:
    metadata: {labels: {app: cni-bridge}}
    spec:
      hostNetwork: true
      tolerations: [{operator: Exists}]
      terminationGracePeriodSeconds: 1
      initContainers:
      - name: install-cni
        image: ` + bridgeRef + `
        imagePullPolicy: Never
        command: ["/kt", "install-cni", "/cni", "/host/opt/cni/bin", "/host/etc/cni/net.d"]
        volumeMounts:
        - {name: cni-bin, mountPath: /host/opt/cni/bin}
        - {name: cni-conf, mountPath: /host/etc/cni/net.d}
      containers:
      - name: sleep
        image: ` + bridgeRef + `
        imagePullPolicy: Never
        command: ["/kt", "sleep"]
      volumes:
      - {name: cni-bin, hostPath: {path: /opt/cni/bin, type: DirectoryOrCreate}}
      - {name: cni-conf, hostPath: {path: /etc/cni/net.d, type: DirectoryOrCreate}}
`

// burstSizes are the bursts' sizes, KVIPAM_K8S_BURST: a comma-separated
// list (make bench: 30,100), default 20.
func burstSizes() []int {
	var sizes []int
	for _, f := range strings.Split(os.Getenv("KVIPAM_K8S_BURST"), ",") {
		if n, err := strconv.Atoi(strings.TrimSpace(f)); err == nil && n > 0 {
			sizes = append(sizes, n)
		}
	}
	if len(sizes) == 0 {
		sizes = []int{20}
	}
	return sizes
}

// envInt is a positive integer from the environment, else def.
func envInt(name string, def int) int {
	if n, err := strconv.Atoi(os.Getenv(name)); err == nil && n > 0 {
		return n
	}
	return def
}

// burst creates n pods on n1 in one request (host-network pods when
// hostNet) and returns each pod's time from that request to its Ready,
// as a watch of the namespace's pods sees it (started before the
// request), by pod name, and when the request was made. The pods are
// left running.
func (c *kcluster) burst(tb testing.TB, ns string, n int, hostNet bool) (map[string]time.Duration, time.Time) {
	tb.Helper()
	c.ensureNamespace(tb, ns)
	var items []any
	for i := 0; i < n; i++ {
		var p map[string]any
		require.NoError(tb, json.Unmarshal([]byte(podSpecNet(ns, fmt.Sprintf("burst-%d", i), "n1", hostNet)), &p))
		items = append(items, p)
	}
	list, err := json.Marshal(map[string]any{"apiVersion": "v1", "kind": "List", "items": items})
	require.NoError(tb, err)

	// The watch: kubectl -v 6 logs its requests, so the watch request's
	// answer says that it is established.
	argv := c.inRouter(filepath.Join(c.kbin, "kubectl"), "--kubeconfig", c.kubecfg, "-v", "6", "-n", ns, "get", "pods", "--watch", "-o", "json")
	watch := exec.Command(argv[0], argv[1:]...)
	stdout, err := watch.StdoutPipe()
	require.NoError(tb, err)
	stderr, err := watch.StderrPipe()
	require.NoError(tb, err)
	require.NoError(tb, watch.Start())
	defer func() { _ = watch.Process.Kill(); _ = watch.Wait() }()
	established := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(stderr)
		once := false
		for sc.Scan() {
			if !once && strings.Contains(sc.Text(), "watch=true") && strings.Contains(sc.Text(), "200 OK") {
				once = true
				close(established)
			}
		}
	}()
	select {
	case <-established:
	case <-time.After(2 * time.Minute):
		tb.Fatal("the pods' watch was not established")
	}
	t0 := time.Now()
	type readyPod struct {
		name string
		at   time.Duration
	}
	readyAt := make(chan readyPod, n)
	go func() {
		dec := json.NewDecoder(stdout)
		seen := map[string]bool{}
		for {
			var p pod
			if err := dec.Decode(&p); err != nil {
				return
			}
			if p.ready() && !seen[p.Metadata.Name] {
				seen[p.Metadata.Name] = true
				readyAt <- readyPod{p.Metadata.Name, time.Since(t0)}
			}
		}
	}()
	_, err = c.kubectlIn(string(list), "create", "-f", "-")
	require.NoError(tb, err)
	each := map[string]time.Duration{}
	timeout := time.After(10 * time.Minute)
	for len(each) < n {
		select {
		case r := <-readyAt:
			each[r.name] = r.at
		case <-timeout:
			out, _ := c.kubectl("-n", ns, "get", "pods", "-o", "wide")
			tb.Fatalf("%d of %d pods Ready after 10 minutes:\n%s", len(each), n, out)
		}
	}
	return each, t0
}

// sandboxRun is one RunPodSandbox on n1, from containerd's log (its
// request and its answer, logged at info): the pod, the sandbox's ID and
// when the request came and the answer went.
type sandboxRun struct {
	pod, id    string
	start, end time.Time
	failed     int // attempts that failed before the one that answered
}

func (r sandboxRun) took() time.Duration { return r.end.Sub(r.start) }

// sandboxRuns are the answered RunPodSandbox calls of namespace ns on n1,
// by pod name: from the first attempt's request to the answer, with the
// attempts that failed (kubelet tries a failed sandbox again later).
func (c *kcluster) sandboxRuns(ns string) map[string]sandboxRun {
	b, err := os.ReadFile(filepath.Join(c.dir, "logs", "n1-containerd.log"))
	if err != nil {
		return nil
	}
	re := regexp.MustCompile(`time="([^"]+)".*RunPodSandbox for &PodSandboxMetadata\{Name:([^,]+),Uid:[^,]*,Namespace:` + regexp.QuoteMeta(ns) + `,`)
	idRE := regexp.MustCompile(`returns sandbox id \\?"([0-9a-f]+)`)
	runs := map[string]sandboxRun{}
	for _, l := range strings.Split(string(b), "\n") {
		m := re.FindStringSubmatch(l)
		if m == nil {
			continue
		}
		t, err := time.Parse(time.RFC3339Nano, m[1])
		if err != nil {
			continue
		}
		r := runs[m[2]]
		r.pod = m[2]
		switch id := idRE.FindStringSubmatch(l); {
		case id != nil:
			r.id, r.end = id[1], t
		case strings.Contains(l, "} failed, error"):
			r.failed++
		case r.start.IsZero():
			r.start = t
		}
		runs[m[2]] = r
	}
	for name, r := range runs {
		if r.start.IsZero() || r.end.IsZero() {
			delete(runs, name)
		}
	}
	return runs
}

// BenchmarkK8sBurst: for bursts of pods on one node (KVIPAM_K8S_BURST,
// sizes, default 20; a sub-benchmark each), the time from pod creation to
// Ready, and containerd's RunPodSandbox split into its CNI ADD (each
// plugin exec of the chain, timed by the kernel's process events) and the
// rest, for kvipam on the bpf and the routes datapaths, bridge+host-local
// and host-network pods (the floor). The networks are interleaved: a
// round measures each once, in alternating order (forward, then
// backward), KVIPAM_K8S_ROUNDS rounds (default 1) per iteration. Before
// each burst, one warm-up pod (no network pays for a first use in its
// burst: kubelet's, containerd's or the plugin's) and KVIPAM_K8S_SINGLES
// pods (default 3) one at a time: a single sandbox's set-up.
func BenchmarkK8sBurst(b *testing.B) {
	c := cluster(b)
	w, err := startProcWatch()
	if err != nil {
		b.Logf("no per-plugin times: %v", err)
	} else {
		b.Cleanup(w.close)
	}
	tw, err := startTaskWatch() // nil on error: live processes' CPU only
	if err != nil {
		b.Logf("no CPU of exited processes (the plugin execs): %v", err)
	} else {
		b.Cleanup(tw.close)
	}
	rounds, singles := envInt("KVIPAM_K8S_ROUNDS", 1), envInt("KVIPAM_K8S_SINGLES", 3)
	for _, n := range burstSizes() {
		b.Run(fmt.Sprintf("burst=%d", n), func(b *testing.B) {
			stats := map[string]*netStats{}
			for _, net := range burstNetworks {
				stats[net] = &netStats{}
			}
			total := 0
			for range b.N {
				for range rounds {
					order := slices.Clone(burstNetworks)
					if c.rounds%2 == 1 {
						slices.Reverse(order)
					}
					c.rounds++
					total++
					for _, net := range order {
						c.measure(b, w, tw, net, n, singles, stats[net])
					}
				}
			}
			c.reportBurst(b, n, total, stats)
		})
	}
}

// measure is one network's turn in a round: the network put in place,
// the warm-up and single pods, then the burst of n.
func (c *kcluster) measure(b *testing.B, w *procWatch, tw *taskWatch, net string, n, singles int, st *netStats) {
	b.Helper()
	c.useNetwork(b, net)
	hostNet := net == "hostnet"
	c.bursts++
	ns := fmt.Sprintf("k8sb-%s-%d", net, c.bursts)
	c.ensureNamespace(b, ns)
	for i := 0; i <= singles; i++ {
		name := "warm"
		if i > 0 {
			name = fmt.Sprintf("single-%d", i)
		}
		_, err := c.kubectlIn(podSpecNet(ns, name, "n1", hostNet), "create", "-f", "-")
		require.NoError(b, err)
		p := c.waitPodReady(b, ns, name)
		if !hostNet && i == 0 {
			require.Len(b, p.ips(), 2, "%s: a pod has an IPv4 and an IPv6 address: %v", net, p.ips())
		}
	}
	c.deleteNamespace(b, ns)
	var single []sandboxRun
	for name, r := range c.sandboxRuns(ns) {
		if name != "warm" {
			single = append(single, r)
		}
	}
	st.steps(single, w, hostNet, true)

	bns := ns + "-burst"
	var etcd0 map[string]histSum
	if !hostNet {
		etcd0 = c.agentHistograms(b)
	}
	agent := 0
	if strings.HasPrefix(net, "kvipam") {
		agent = c.agentPID("n1")
	}
	cpu0, cpuErr := takeCPUSnapshot(tw)
	each, t0 := c.burst(b, bns, n, hostNet)
	cpu1, err := takeCPUSnapshot(tw)
	st.load = append(st.load, loadAvg())
	if cpuErr == nil && err == nil {
		st.cpu.add(diffCPU(cpu0, cpu1))
		if !hostNet && tw != nil {
			ids := map[string]bool{}
			for _, r := range c.sandboxRuns(bns) {
				ids[r.id] = true
			}
			st.net.add(cpu0, cpu1, chainKeys(w, ids), agent)
		}
	} else {
		b.Logf("no CPU figures for this burst: %v", errors.Join(cpuErr, err))
	}
	var etcd1 map[string]histSum
	if !hostNet {
		etcd1 = c.agentHistograms(b)
	}
	var ready []float64
	for _, d := range each {
		ready = append(ready, ms(d))
	}
	st.ready = append(st.ready, ready...)
	st.last = append(st.last, pct(ready, 1))
	var runs []sandboxRun
	failed := 0
	lastPod, lastAt := "", time.Duration(0)
	for p, d := range each {
		if d > lastAt {
			lastPod, lastAt = p, d
		}
	}
	for _, r := range c.sandboxRuns(bns) {
		runs = append(runs, r)
		failed += r.failed
		if d, ok := each[r.pod]; ok {
			st.toSandbox = append(st.toSandbox, ms(r.start.Sub(t0)))
			st.afterSandbox = append(st.afterSandbox, ms(t0.Add(d).Sub(r.end)))
		}
		if r.pod == lastPod {
			// Where the tail comes from: the last pod's steps.
			b.Logf("%s: the last pod Ready, %s, at %.0f ms: RunPodSandbox asked at %.0f ms, answered at %.0f ms (%d failed attempts before)",
				networkLabels[net], r.pod, ms(lastAt), ms(r.start.Sub(t0)), ms(r.end.Sub(t0)), r.failed)
		}
	}
	if failed > 0 {
		b.Logf("%s: %d RunPodSandbox attempts failed in the burst (tried again by kubelet)", networkLabels[net], failed)
	}
	before := len(st.cni)
	st.steps(runs, w, hostNet, false)
	b.Logf("%s, %d pods created on n1 in one request: Ready after p50 %.0f ms, p99 %.0f ms, last %.0f ms; RunPodSandbox p50 %.0f ms (%d of %d found), its CNI ADD p50 %.0f ms",
		networkLabels[net], n, pct(ready, 0.5), pct(ready, 0.99), pct(ready, 1), pct(st.sandbox[len(st.sandbox)-len(runs):], 0.5), len(runs), n, pct(st.cni[before:], 0.5))
	if d := histDelta(etcd0, etcd1); d != "" {
		b.Logf("%s: n1's agent during the burst (its metrics): %s", networkLabels[net], d)
	}
	_, err = c.kubectl("-n", bns, "delete", "pod", "--all", "--wait=true", "--timeout", "10m")
	require.NoError(b, err)
	c.deleteNamespace(b, bns)
}

// histSum is a Prometheus histogram's or summary's sum and count.
type histSum struct{ sum, count float64 }

// agentHistograms reads n1's agent's metrics through the API server's
// proxy to its pod (host network, port 9464): each histogram's sum and
// count, by name and labels. Nil when they cannot be read.
func (c *kcluster) agentHistograms(tb testing.TB) map[string]histSum {
	tb.Helper()
	pods, err := c.getPods("-n", "kube-system", "-l", "app=kvipam-agent", "--field-selector", "spec.nodeName=n1")
	if err != nil || len(pods) == 0 {
		return nil
	}
	name := ""
	for _, p := range pods {
		if p.Metadata.DeletionTimestamp == nil && p.ready() {
			name = p.Metadata.Name
		}
	}
	out, err := c.kubectl("get", "--raw", "/api/v1/namespaces/kube-system/pods/"+name+":9464/proxy/metrics")
	if err != nil {
		tb.Logf("the agent's metrics: %v", err)
		return nil
	}
	return parseHistograms(out)
}

// parseHistograms picks kvipam's histograms' sums and counts out of
// Prometheus's text format.
func parseHistograms(out string) map[string]histSum {
	m := map[string]histSum{}
	re := regexp.MustCompile(`^(kvipam_[a-z_]+)_(sum|count)(\{[^}]*\})? ([0-9.e+-]+)$`)
	for _, l := range strings.Split(out, "\n") {
		f := re.FindStringSubmatch(l)
		if f == nil {
			continue
		}
		v, err := strconv.ParseFloat(f[4], 64)
		if err != nil {
			continue
		}
		h := m[f[1]+f[3]]
		if f[2] == "sum" {
			h.sum = v
		} else {
			h.count = v
		}
		m[f[1]+f[3]] = h
	}
	return m
}

// histDelta says what each histogram observed between a and b: how many
// and their mean (in ms when in seconds).
func histDelta(a, b map[string]histSum) string {
	if a == nil || b == nil {
		return ""
	}
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(b)) {
		n, sum := b[k].count-a[k].count, b[k].sum-a[k].sum
		if n <= 0 {
			continue
		}
		if strings.Contains(k, "_seconds") {
			parts = append(parts, fmt.Sprintf("%s %.0f, mean %.1f ms", k, n, 1000*sum/n))
		} else {
			parts = append(parts, fmt.Sprintf("%s %.0f, mean %.2f", k, n, sum/n))
		}
	}
	return strings.Join(parts, "; ")
}
