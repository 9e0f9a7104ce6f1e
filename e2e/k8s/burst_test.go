package k8s

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
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

func burstSize() int {
	if n, err := strconv.Atoi(os.Getenv("KVIPAM_K8S_BURST")); err == nil && n > 0 {
		return n
	}
	return 20
}

// burst creates n pods on n1 in one request and returns each pod's time
// from that request to its Ready, as a watch of the namespace's pods sees
// it (started before the request).
func (c *kcluster) burst(tb testing.TB, ns string, n int) []time.Duration {
	tb.Helper()
	c.ensureNamespace(tb, ns)
	var items []any
	for i := 0; i < n; i++ {
		var p map[string]any
		require.NoError(tb, json.Unmarshal([]byte(podSpec(ns, fmt.Sprintf("burst-%d", i), "n1", nil)), &p))
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
	readyAt := make(chan time.Duration, n)
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
				readyAt <- time.Since(t0)
			}
		}
	}()
	_, err = c.kubectlIn(string(list), "create", "-f", "-")
	require.NoError(tb, err)
	var each []time.Duration
	timeout := time.After(10 * time.Minute)
	for len(each) < n {
		select {
		case d := <-readyAt:
			each = append(each, d)
		case <-timeout:
			out, _ := c.kubectl("-n", ns, "get", "pods", "-o", "wide")
			tb.Fatalf("%d of %d pods Ready after 10 minutes:\n%s", len(each), n, out)
		}
	}
	_, err = c.kubectl("-n", ns, "delete", "pod", "--all", "--wait=true", "--timeout", "10m")
	require.NoError(tb, err)
	sort.Slice(each, func(i, j int) bool { return each[i] < each[j] })
	return each
}

// sandboxTimes is how long each RunPodSandbox of namespace ns took on n1,
// from containerd's log (its request and its answer, logged at info).
func (c *kcluster) sandboxTimes(ns string) []time.Duration {
	b, err := os.ReadFile(filepath.Join(c.dir, "logs", "n1-containerd.log"))
	if err != nil {
		return nil
	}
	re := regexp.MustCompile(`time="([^"]+)".*RunPodSandbox for &PodSandboxMetadata\{Name:([^,]+),Uid:[^,]*,Namespace:` + regexp.QuoteMeta(ns) + `,`)
	start, end := map[string]time.Time{}, map[string]time.Time{}
	for _, l := range strings.Split(string(b), "\n") {
		m := re.FindStringSubmatch(l)
		if m == nil {
			continue
		}
		t, err := time.Parse(time.RFC3339Nano, m[1])
		if err != nil {
			continue
		}
		if strings.Contains(l, "returns sandbox id") {
			end[m[2]] = t
		} else if _, ok := start[m[2]]; !ok {
			start[m[2]] = t
		}
	}
	var d []time.Duration
	for name, t := range start {
		if e, ok := end[name]; ok {
			d = append(d, e.Sub(t))
		}
	}
	sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
	return d
}

// BenchmarkK8sBurst: for a burst of pods on one node (KVIPAM_K8S_BURST,
// default 20), the time from pod creation to Ready, with kvipam and with
// bridge+host-local, each installed by a DaemonSet; kvipam first (bridge
// needs kvipam's conflist gone: containerd uses the first one).
func BenchmarkK8sBurst(b *testing.B) {
	c := cluster(b)
	n := burstSize()
	report := func(b *testing.B, name string) {
		// One pod first, so that neither network pays for a first use
		// (kubelet's, containerd's or the plugin's) in its burst.
		warm := "burst-warm-" + name
		c.runPod(b, warm, "warm", "n1", nil)
		c.deleteNamespace(b, warm)
		b.ResetTimer()
		var firsts, medians, lasts, sandboxes []float64
		for range b.N {
			// A namespace per burst: the sandbox times are found by it.
			c.bursts++
			ns := fmt.Sprintf("burst-%s-%d", name, c.bursts)
			each := c.burst(b, ns, n)
			firsts = append(firsts, each[0].Seconds())
			medians = append(medians, each[len(each)/2].Seconds())
			lasts = append(lasts, each[len(each)-1].Seconds())
			b.Logf("%s: %d pods created on n1 in one request: Ready after first %s, median %s, last %s",
				name, n, each[0].Round(time.Millisecond), each[len(each)/2].Round(time.Millisecond), each[len(each)-1].Round(time.Millisecond))
			if sb := c.sandboxTimes(ns); len(sb) > 0 {
				sandboxes = append(sandboxes, sb[len(sb)/2].Seconds())
				b.Logf("%s: containerd's RunPodSandbox (the sandbox and its CNI ADD) took min %s, median %s, max %s",
					name, sb[0].Round(time.Millisecond), sb[len(sb)/2].Round(time.Millisecond), sb[len(sb)-1].Round(time.Millisecond))
			}
		}
		if len(sandboxes) > 0 {
			b.ReportMetric(avg(sandboxes), "s-median-sandbox")
		}
		b.ReportMetric(avg(firsts), "s-first-ready")
		b.ReportMetric(avg(medians), "s-median-ready")
		b.ReportMetric(avg(lasts), "s-all-ready")
		b.ReportMetric(0, "ns/op")
	}
	b.Run("kvipam", func(b *testing.B) {
		c.install(b)
		report(b, "kvipam")
	})
	b.Run("bridge", func(b *testing.B) {
		if c.installed {
			c.uninstall(b)
		}
		if !c.bridgeOn {
			path := filepath.Join(c.dir, "cni-bridge.yaml")
			require.NoError(b, os.WriteFile(path, []byte(bridgeDaemonSet), 0o644))
			_, err := c.kubectl("apply", "-f", path)
			require.NoError(b, err)
			c.bridgeOn = true
			c.waitDaemonSet(b, "cni-bridge")
			c.waitNodesReady(b)
		}
		report(b, "bridge")
	})
}

func avg(v []float64) float64 {
	var s float64
	for _, x := range v {
		s += x
	}
	return s / float64(len(v))
}
