package k8s

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// pingEventually execs a ping from ns/from to addr until it answers: a
// route to a block another node just took appears when that node's agent
// sees the block in etcd (a watch).
func (c *kcluster) pingEventually(tb testing.TB, ns, from, addr string) {
	tb.Helper()
	require.NoError(tb, waitFor(2*time.Minute, fmt.Sprintf("%s/%s reaches %s", ns, from, addr), func() error {
		return c.ping(ns, from, addr)
	}))
}

func (c *kcluster) pingBoth(tb testing.TB, ns string, a, b pod) {
	tb.Helper()
	for _, ip := range b.ips() {
		c.pingEventually(tb, ns, a.Metadata.Name, ip)
	}
	for _, ip := range a.ips() {
		c.pingEventually(tb, ns, b.Metadata.Name, ip)
	}
}

func (c *kcluster) deleteNamespace(tb testing.TB, ns string) {
	tb.Helper()
	_, err := c.kubectl("delete", "namespace", ns, "--ignore-not-found", "--wait=true", "--timeout", "5m")
	require.NoError(tb, err)
}

// TestK8sDaemonSetInstall: kvipam installed as docs/kubernetes.md says
// (the Secret, the ConfigMap, kubectl apply of make image's manifest):
// the DaemonSet's controller puts an agent on each node, each pod's
// install-cni init container ran to completion, the agents are Ready, and
// both nodes become Ready (their runtime has a network configuration).
func TestK8sDaemonSetInstall(t *testing.T) {
	c := cluster(t)
	c.install(t)
	pods, err := c.getPods("-n", "kube-system", "-l", "app=kvipam-agent")
	require.NoError(t, err)
	nodes := map[string]bool{}
	for _, p := range pods {
		if p.Metadata.DeletionTimestamp != nil {
			continue
		}
		nodes[p.Spec.NodeName] = true
		require.True(t, p.ready(), "agent %s is Ready", p.Metadata.Name)
		require.Len(t, p.Status.InitStatuses, 1, "one init container")
		init := p.Status.InitStatuses[0]
		require.Equal(t, "install-cni", init.Name)
		require.NotNil(t, init.State.Terminated, "install-cni has run")
		require.Equal(t, 0, init.State.Terminated.ExitCode)
		require.Equal(t, "Completed", init.State.Terminated.Reason)
	}
	require.Equal(t, map[string]bool{"n1": true, "n2": true}, nodes, "an agent on each node")
	out, err := c.kubectl("get", "nodes", "-o", "jsonpath={range .items[*]}{.metadata.name}={.status.conditions[?(@.type==\"Ready\")].status} {end}")
	require.NoError(t, err)
	require.Equal(t, "n1=True n2=True", strings.TrimSpace(out))
}

// TestK8sPodsAcrossNodes: a pod on each node gets an IPv4 and an IPv6
// address from the default pool, they ping each other across the nodes
// in both families, etcd's records of their addresses name each pod's
// namespace, name and current UID, and deleting the pods leaves no record.
func TestK8sPodsAcrossNodes(t *testing.T) {
	c := cluster(t)
	c.install(t)
	const ns = "k8s-pods"
	t.Cleanup(func() { c.deleteNamespace(t, ns) })
	a := c.runPod(t, ns, "a", "n1", nil)
	b := c.runPod(t, ns, "b", "n2", nil)
	require.Equal(t, "n1", a.Spec.NodeName)
	require.Equal(t, "n2", b.Spec.NodeName)
	requireIPsIn(t, a, "default")
	requireIPsIn(t, b, "default")
	c.requireRecords(t, a)
	c.requireRecords(t, b)
	c.pingBoth(t, ns, a, b)
	c.deletePod(t, ns, "a")
	c.deletePod(t, ns, "b")
	c.waitNoRecords(t, ns, "a")
	c.waitNoRecords(t, ns, "b")
}

// TestK8sPoolSelection: the pool rules through the API: a pod with no
// rule gets the default pool, a pod annotated kvipam.io/pool: blue gets
// blue, and a pod in a namespace bound with kvipamctl pool bind-namespace
// gets the bound pool; the pods reach each other across the pools.
func TestK8sPoolSelection(t *testing.T) {
	c := cluster(t)
	c.install(t)
	const ns, bound = "k8s-pool", "k8s-pool-green"
	t.Cleanup(func() {
		c.deleteNamespace(t, ns)
		c.deleteNamespace(t, bound)
		_, _ = c.kvipamctl("pool", "unbind-namespace", bound)
	})
	// The binding first: agents follow bindings with a watch.
	_, err := c.kvipamctl("pool", "bind-namespace", bound, "green")
	require.NoError(t, err)
	dflt := c.runPod(t, ns, "dflt", "n1", nil)
	blue := c.runPod(t, ns, "blue", "n2", map[string]string{"kvipam.io/pool": "blue"})
	green := c.runPod(t, bound, "green", "n1", nil)
	requireIPsIn(t, dflt, "default")
	requireIPsIn(t, blue, "blue")
	requireIPsIn(t, green, "green")
	for _, p := range []pod{dflt, blue, green} {
		c.requireRecords(t, p)
	}
	for _, ip := range blue.ips() {
		c.pingEventually(t, ns, "dflt", ip)
	}
	for _, ip := range green.ips() {
		c.pingEventually(t, ns, "blue", ip)
	}
	c.deletePod(t, ns, "blue")
	c.waitNoRecords(t, ns, "blue")
}

// TestK8sStickyStatefulSetAcrossNodes: a StatefulSet pod annotated
// kvipam.io/sticky, deleted while its node is cordoned, is re-created by
// the StatefulSet controller (a new UID) on the other node and keeps its
// addresses; etcd's records name the new UID, and a pod on the first node
// reaches it there.
func TestK8sStickyStatefulSetAcrossNodes(t *testing.T) {
	c := cluster(t)
	c.install(t)
	const ns = "k8s-sticky"
	c.ensureNamespace(t, ns)
	t.Cleanup(func() {
		_, _ = c.kubectl("uncordon", "n1")
		_, _ = c.kubectl("uncordon", "n2")
		c.deleteNamespace(t, ns)
	})
	tmpl := podTemplateSpec("")
	sts := map[string]any{
		"apiVersion": "apps/v1", "kind": "StatefulSet",
		"metadata": map[string]any{"name": "db", "namespace": ns},
		"spec": map[string]any{
			"serviceName": "db", "replicas": 1,
			"selector": map[string]any{"matchLabels": map[string]string{"app": "db"}},
			"template": map[string]any{
				"metadata": map[string]any{"labels": map[string]string{"app": "db"}, "annotations": map[string]string{"kvipam.io/sticky": "10m"}},
				"spec":     tmpl,
			},
		},
	}
	b, err := json.Marshal(sts)
	require.NoError(t, err)
	_, err = c.kubectlIn(string(b), "create", "-f", "-")
	require.NoError(t, err)
	require.NoError(t, waitFor(5*time.Minute, "db-0 created", func() error {
		_, err := c.getPod(ns, "db-0")
		return err
	}))
	first := c.waitPodReady(t, ns, "db-0")
	v4, v6 := requireIPsIn(t, first, "default")
	c.requireRecords(t, first)
	from := first.Spec.NodeName
	other := map[string]string{"n1": "n2", "n2": "n1"}[from]
	require.NotEmpty(t, other)

	// Its node cordoned, the pod deleted: the controller re-creates it, and
	// the scheduler can only put it on the other node.
	_, err = c.kubectl("cordon", from)
	require.NoError(t, err)
	c.deletePod(t, ns, "db-0")
	var second pod
	require.NoError(t, waitFor(5*time.Minute, "db-0 re-created with a new UID", func() error {
		p, err := c.getPod(ns, "db-0")
		if err != nil {
			return err
		}
		if p.Metadata.UID == first.Metadata.UID {
			return fmt.Errorf("still the old pod")
		}
		second = p
		return nil
	}))
	second = c.waitPodReady(t, ns, "db-0")
	require.NotEqual(t, first.Metadata.UID, second.Metadata.UID)
	require.Equal(t, other, second.Spec.NodeName, "re-created on the other node")
	v4b, v6b := requireIPsIn(t, second, "default")
	require.Equal(t, v4, v4b, "the IPv4 address followed the pod")
	require.Equal(t, v6, v6b, "the IPv6 address followed the pod")
	c.requireRecords(t, second)

	// A pod on the first node reaches it on the other node.
	_, err = c.kubectl("uncordon", from)
	require.NoError(t, err)
	c.runPod(t, ns, "probe", from, nil)
	c.pingEventually(t, ns, "probe", v4.String())
	c.pingEventually(t, ns, "probe", v6.String())
}

// TestK8sRolloutRestartKeepsPods: kubectl rollout restart of the agents'
// DaemonSet replaces every agent (new pods), and every running pod keeps
// its UID, its addresses, its records and its connectivity across the
// nodes; a pod created after the restart gets an address and reaches them.
func TestK8sRolloutRestartKeepsPods(t *testing.T) {
	c := cluster(t)
	c.install(t)
	const ns = "k8s-roll"
	t.Cleanup(func() { c.deleteNamespace(t, ns) })
	r1 := c.runPod(t, ns, "r1", "n1", nil)
	r2 := c.runPod(t, ns, "r2", "n2", nil)
	c.pingBoth(t, ns, r1, r2)
	agentsBefore, err := c.getPods("-n", "kube-system", "-l", "app=kvipam-agent")
	require.NoError(t, err)

	_, err = c.kubectl("-n", "kube-system", "rollout", "restart", "ds/kvipam-agent")
	require.NoError(t, err)
	c.waitDaemonSet(t, "kvipam-agent")
	agentsAfter, err := c.getPods("-n", "kube-system", "-l", "app=kvipam-agent")
	require.NoError(t, err)
	old := map[string]bool{}
	for _, p := range agentsBefore {
		old[p.Metadata.UID] = true
	}
	for _, p := range agentsAfter {
		require.False(t, old[p.Metadata.UID], "agent %s was replaced", p.Metadata.Name)
	}

	for _, before := range []pod{r1, r2} {
		after, err := c.getPod(ns, before.Metadata.Name)
		require.NoError(t, err)
		require.Equal(t, before.Metadata.UID, after.Metadata.UID, "the pod was not re-created")
		require.True(t, after.ready())
		require.Equal(t, before.ips(), after.ips(), "the pod kept its addresses")
		require.Equal(t, 0, after.Status.ContainerStatuses[0].RestartCount)
		c.requireRecords(t, after)
	}
	c.pingBoth(t, ns, r1, r2)
	r3 := c.runPod(t, ns, "r3", "n1", nil)
	requireIPsIn(t, r3, "default")
	c.pingBoth(t, ns, r3, r2)
}

// TestK8sUninstall: docs/kubernetes.md's uninstall steps (the pods that
// use kvipam deleted, the agents' manifest deleted, the uninstall
// DaemonSet applied, awaited and deleted) leave no kvipam conflist and no
// kvipam plugin on either node, and kubelet then reports each node's
// network not ready.
func TestK8sUninstall(t *testing.T) {
	c := cluster(t)
	c.install(t)
	const ns = "k8s-uninstall"
	u := c.runPod(t, ns, "u", "n2", nil)
	requireIPsIn(t, u, "default")
	// 1. Delete the pods that use kvipam.
	c.deleteNamespace(t, ns)
	c.waitNoRecords(t, ns, "u")
	// 2. and 3.
	c.uninstall(t)
	for _, n := range c.nodes {
		argv := c.inNode(n, "ls", "-A", "/etc/cni/net.d", "/opt/cni/bin")
		out, err := run(argv[0], argv[1:]...)
		require.NoError(t, err)
		require.NotContains(t, out, "10-kvipam.conflist", "node %s", n.name)
		for _, f := range strings.Fields(out) {
			require.NotContains(t, []string{"kvipam", "kvipam-ipam"}, f, "node %s keeps a kvipam plugin", n.name)
		}
	}
	// Through the API: with no network configuration, kubelet reports the
	// node's runtime network not ready.
	for _, n := range []string{"n1", "n2"} {
		_, err := c.kubectl("wait", "--for=condition=Ready=false", "node/"+n, "--timeout", "5m")
		require.NoError(t, err, "node %s NotReady with no network", n)
	}
}

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

// burst creates n pods on n1 in one request, waits until all are Ready,
// and returns the time from the request to the last Ready and each pod's
// creation-to-Ready time (the API's timestamps: one-second resolution).
func (c *kcluster) burst(tb testing.TB, ns string, n int) (time.Duration, []time.Duration) {
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
	t0 := time.Now()
	_, err = c.kubectlIn(string(list), "create", "-f", "-")
	require.NoError(tb, err)
	_, err = c.kubectl("-n", ns, "wait", "--for=condition=Ready", "pod", "--all", "--timeout", "10m")
	wall := time.Since(t0)
	require.NoError(tb, err)
	pods, err := c.getPods("-n", ns)
	require.NoError(tb, err)
	var each []time.Duration
	for _, p := range pods {
		for _, cond := range p.Status.Conditions {
			if cond.Type == "Ready" && cond.Status == "True" {
				each = append(each, cond.LastTransitionTime.Sub(p.Metadata.CreationTimestamp))
			}
		}
	}
	require.Len(tb, each, n)
	_, err = c.kubectl("-n", ns, "delete", "pod", "--all", "--wait=true", "--timeout", "10m")
	require.NoError(tb, err)
	sort.Slice(each, func(i, j int) bool { return each[i] < each[j] })
	return wall, each
}

// BenchmarkK8sBurst: for a burst of pods on one node (KVIPAM_K8S_BURST,
// default 20), the time from pod creation to Ready, with kvipam and with
// bridge+host-local, each installed by a DaemonSet; kvipam first (bridge
// needs kvipam's conflist gone: containerd uses the first one).
func BenchmarkK8sBurst(b *testing.B) {
	c := cluster(b)
	n := burstSize()
	report := func(b *testing.B, name string) {
		var walls, means, maxes []float64
		for i := 0; i < b.N; i++ {
			wall, each := c.burst(b, fmt.Sprintf("burst-%s-%d", name, i), n)
			var sum time.Duration
			for _, d := range each {
				sum += d
			}
			walls = append(walls, wall.Seconds())
			means = append(means, (sum / time.Duration(len(each))).Seconds())
			maxes = append(maxes, each[len(each)-1].Seconds())
			b.Logf("%s: %d pods on n1: all Ready %s after the create request; creation to Ready per pod (1 s resolution): median %s, max %s",
				name, n, wall.Round(time.Millisecond), each[len(each)/2], each[len(each)-1])
		}
		b.ReportMetric(avg(walls), "s-all-ready")
		b.ReportMetric(avg(means), "s-mean-pod-ready")
		b.ReportMetric(avg(maxes), "s-max-pod-ready")
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
