package k8s

import (
	"encoding/json"
	"fmt"
	"net/netip"
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
// (etcd's role and user for kvipam with authentication turned on in
// docs/operations.md's order for an etcd shared with Kubernetes, the
// Secret, the ConfigMap, kubectl apply of make image's manifest):
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
	// Ready through the kubelet's HTTP probes, on the agent's metrics
	// listener (the node's address), not exec probes.
	probes, err := c.kubectl("-n", "kube-system", "get", "ds", "kvipam-agent", "-o",
		`jsonpath={.spec.template.spec.containers[0].readinessProbe.httpGet.path} {.spec.template.spec.containers[0].livenessProbe.httpGet.path}`)
	require.NoError(t, err)
	require.Equal(t, "/readyz /livez", strings.TrimSpace(probes))
	for _, p := range pods {
		logs, err := c.kubectl("-n", "kube-system", "logs", p.Metadata.Name, "-c", "agent")
		require.NoError(t, err)
		for _, l := range strings.Split(logs, "\n") {
			if strings.Contains(l, "datapath") || strings.Contains(l, "[WARN]") || strings.Contains(l, "[ERROR]") {
				t.Logf("%s: %s", p.Spec.NodeName, l)
			}
		}
	}
	out, err := c.kubectl("get", "nodes", "-o", "jsonpath={range .items[*]}{.metadata.name}={.status.conditions[?(@.type==\"Ready\")].status} {end}")
	require.NoError(t, err)
	require.Equal(t, "n1=True n2=True", strings.TrimSpace(out))
	// kubelet set its sysctls in the scratch files over /proc/sys in each
	// node's mount namespace; the host's are as they were.
	for _, n := range c.nodes {
		require.Equal(t, kubeletSysctls, n.sysctls(), "node %s: kubelet's sysctls in its scratch files", n.name)
	}
	require.Equal(t, c.hostSysctls, readSysctls(), "the host's sysctls are untouched")
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
	t.Logf("a on %s %v (uid %s), b on %s %v (uid %s)", a.Spec.NodeName, a.ips(), a.Metadata.UID, b.Spec.NodeName, b.ips(), b.Metadata.UID)
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
	// Agents follow bindings with a watch: the first pod of the bound
	// namespace that n1's agent gives the green pool shows it has seen the
	// binding (a pod before that gets the default pool, and is deleted).
	var green pod
	require.NoError(t, waitFor(3*time.Minute, "n1's agent follows the binding", func() error {
		green = c.runPod(t, bound, "green", "n1", nil)
		if a, _ := netip.ParseAddr(green.ips()[0]); netip.MustParsePrefix(pools["green"][0]).Contains(a) || netip.MustParsePrefix(pools["green"][1]).Contains(a) {
			return nil
		}
		c.deletePod(t, bound, "green")
		return fmt.Errorf("pod got %v", green.ips())
	}))
	requireIPsIn(t, dflt, "default")
	requireIPsIn(t, blue, "blue")
	requireIPsIn(t, green, "green")
	for _, p := range []pod{dflt, blue, green} {
		c.requireRecords(t, p)
		t.Logf("%s/%s on %s: %v", p.Metadata.Namespace, p.Metadata.Name, p.Spec.NodeName, p.ips())
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
	sts := stickyStatefulSet(ns)
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
	t.Logf("db-0 uid %s on %s %v, re-created as uid %s on %s %v", first.Metadata.UID, from, first.ips(), second.Metadata.UID, second.Spec.NodeName, second.ips())

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
	t.Logf("agents replaced; r1 %v and r2 %v kept their UIDs and addresses and reach each other", r1.ips(), r2.ips())
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
	t.Logf("both nodes: no kvipam conflist or plugin left; NotReady (no network configuration)")
}
