package k8s

import (
	"encoding/json"
	"fmt"
	"maps"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The release the DaemonSet is installed from, upgraded from and rolled
// back to.
const oldRelease = "v0.1.0"

// The blocks of docs/operations.md's "Upgrading agents (rolling)".
const (
	opsDoc        = "docs/operations.md"
	opsSection    = "Upgrading agents (rolling)"
	stepCheck     = "Check: before the first node and after each one"
	stepHold      = "Hold the roll and set the image"
	stepNode      = "Replace the agent on NODE"
	stepRelease   = "Release the roll"
	stepClear     = "Clear what OLD does not know, for each POOL that validate names"
	stepDowngrade = "Bring the level down to OLD's"
	stepUnhold    = "After upgrading again: the level no longer held"
)

// TestK8sRollingUpgradeAndRollback: docs/operations.md's upgrade and
// rollback of the agents' DaemonSet, its commands run as written. The
// DaemonSet is installed from the v0.1.0 release's image (built from git
// at its recorded commit), rolled to HEAD's image one node at a time,
// back to v0.1.0 (the cluster's schema level brought down first), and
// forward again. Meanwhile a pod on each node pings a pod on the other
// every 100 ms in both families, and after every node's step a sticky
// StatefulSet pod is deleted with its node cordoned and re-created on the
// other node. After every node's step: kvipamctl check is clean, each
// node's agent reports the version expected, no pod changed its UID or
// addresses or restarted, no echo was lost, and the sticky pod kept its
// addresses.
func TestK8sRollingUpgradeAndRollback(t *testing.T) {
	c := cluster(t)
	old := c.buildRelease(t, oldRelease)
	oldRef, err := imageRef(old.agentYAML)
	require.NoError(t, err)
	require.Equal(t, "ghcr.io/kvipam/kvipam:"+oldRelease, oldRef, "the release's manifest names its image")
	headRef, err := imageRef(c.agentYAML)
	require.NoError(t, err)
	headVersion := headRef[strings.LastIndex(headRef, ":")+1:] // make image tags the image with VERSION
	c.importImage(t, old.tar)
	proc := c.readProcedure(t, opsDoc, opsSection)
	c.freshInstall(t, old.agentYAML)
	// A failure leaves the DaemonSet at any version: uninstalled (after
	// the namespace's pods went), the next test installs HEAD's afresh.
	t.Cleanup(func() {
		if t.Failed() && c.installed {
			c.uninstall(t)
		}
	})

	const ns = "k8s-upgrade"
	t.Cleanup(func() {
		_, _ = c.kubectl("uncordon", "n1")
		_, _ = c.kubectl("uncordon", "n2")
		c.deleteNamespace(t, ns)
	})
	w := c.startWorkload(t, ns)
	want := map[string]string{"n1": oldRelease, "n2": oldRelease}
	c.requireAgentVersions(t, want)
	c.requireLevel(t, "v0.1.0 installed", 1, false)
	proc.run(t, c, stepCheck)

	// roll is steps 1 to 3 with image; after each node's step, level and
	// held are the cluster's schema level and whether a downgrade holds it.
	roll := func(stage, image, version string, level func(node string) int, held bool) {
		t.Helper()
		t0 := time.Now()
		proc.run(t, c, stepHold, "IMAGE="+image)
		for _, node := range []string{"n1", "n2"} {
			proc.run(t, c, stepNode, "NODE="+node)
			want[node] = version
			step := fmt.Sprintf("%s, %s at %s", stage, node, version)
			c.requireAgentVersions(t, want)
			c.requireLevel(t, step, level(node), held)
			_, err := c.kvipamctl("check")
			require.NoError(t, err, "%s: kvipamctl check is clean", step)
			w.requireKept(t, c, step)
			w.moveSticky(t, c, step)
			w.requireKept(t, c, step+", the sticky pod moved")
		}
		proc.run(t, c, stepRelease)
		logf("%s: both nodes at %s in %s", stage, version, time.Since(t0).Round(time.Second))
	}
	// HEAD's highest level (kvipamctl is HEAD's): the agents raise the
	// cluster to it once both nodes run HEAD.
	head := c.headLevel(t)
	// Upgraded, the agents raise the level once both understand level 2;
	// while n2 runs v0.1.0, level 2's feature is refused.
	roll("upgrade", headRef, headVersion, func(node string) int {
		if node == "n1" {
			_, err := c.kvipamctl("pool", "set-max-blocks", "blue", "4")
			require.Error(t, err, "pool set-max-blocks is refused while n2 runs v0.1.0")
			return 1
		}
		return head
	}, false)
	// Level 2's feature in use: the downgrade is refused, naming the pool,
	// until the pool is cleared as the procedure says.
	_, err = c.kvipamctl("pool", "set-max-blocks", "blue", "4")
	require.NoError(t, err)
	for _, verb := range []string{"validate", "enable"} {
		out, err := c.kvipamctl("downgrade", verb, oldRelease)
		require.Error(t, err, "downgrade %s %s with pool blue's max-blocks set", verb, oldRelease)
		require.Contains(t, out, "blue", "downgrade %s names what needs level 2", verb)
	}
	c.requireLevel(t, "the downgrade refused", head, false)
	proc.run(t, c, stepClear, "POOL=blue")
	proc.run(t, c, stepDowngrade, "OLD="+oldRelease)
	c.requireLevel(t, "the downgrade enabled", 1, true)
	// Back to v0.1.0 and forward again under the held level.
	roll("rollback", oldRef, oldRelease, func(string) int { return 1 }, true)
	roll("upgrade again", headRef, headVersion, func(string) int { return 1 }, true)
	proc.run(t, c, stepUnhold)
	c.requireLevel(t, "the downgrade cancelled", head, false)
	proc.run(t, c, stepCheck)
	w.finish(t, c)

	// The DaemonSet as install leaves it, for the tests after this one:
	// HEAD's manifest applied (the same template as the roll made: no
	// agent restarts unless the two releases' manifests differ).
	manifest, err := c.agentManifest()
	require.NoError(t, err)
	_, err = c.kubectl("apply", "-f", manifest)
	require.NoError(t, err)
	c.waitDaemonSet(t, "kvipam-agent")
}

// freshInstall installs kvipam from manifest (a release's) on a cluster
// where kvipam has not run, or has been uninstalled and forgotten as
// docs/kubernetes.md's "Uninstalling" says (an earlier test's install).
func (c *kcluster) freshInstall(tb testing.TB, manifest string) {
	tb.Helper()
	if c.installed {
		// The earlier tests' pods are gone with their namespaces.
		c.uninstall(tb)
	}
	if c.etcdAuth {
		p := func(n string) string { return filepath.Join(c.pki, n) }
		argv := c.inRouter(filepath.Join(c.bin, "etcdauth"), "--endpoint", etcdURL, "--cacert", p("ca.crt"),
			"--cert", p("kvipam.crt"), "--key", p("kvipam.key"), "--forget")
		out, err := run(argv[0], argv[1:]...)
		require.NoError(tb, err)
		logf("%s", strings.TrimSpace(out))
		for _, n := range c.nodes {
			argv := c.inNode(n, "rm", "-rf", "/var/lib/kvipam", "/run/kvipam")
			_, err := run(argv[0], argv[1:]...)
			require.NoError(tb, err)
		}
	}
	c.installFrom(tb, manifest)
}

// clusterLevel is kvipamctl version's view of etcd: the cluster's schema
// level, whether a downgrade holds it, and each live node's version.
type clusterLevel struct {
	Level     int  `json:"level"`
	Downgrade bool `json:"downgrade"`
	Nodes     []struct {
		Name    string `json:"name"`
		Version string `json:"version"`
		Level   int    `json:"level"`
	} `json:"nodes"`
}

func (c *kcluster) clusterLevel() (clusterLevel, error) {
	out, err := c.kvipamctl("-o", "json", "version")
	if err != nil {
		return clusterLevel{}, err
	}
	var v struct {
		Cluster *clusterLevel `json:"cluster"`
	}
	if err := json.Unmarshal([]byte(out), &v); err != nil {
		return clusterLevel{}, fmt.Errorf("decode kvipamctl version: %w: %s", err, tail(out, 500))
	}
	if v.Cluster == nil {
		return clusterLevel{}, fmt.Errorf("kvipamctl version says nothing of the cluster: %s", tail(out, 500))
	}
	return *v.Cluster, nil
}

// headLevel is the highest schema level HEAD's kvipamctl knows.
func (c *kcluster) headLevel(tb testing.TB) int {
	tb.Helper()
	out, err := c.kvipamctl("-o", "json", "version")
	require.NoError(tb, err, "kvipamctl version: %s", tail(out, 500))
	var v struct {
		SchemaLevel int `json:"schemaLevel"`
	}
	require.NoError(tb, json.Unmarshal([]byte(out), &v), "kvipamctl version: %s", tail(out, 500))
	require.GreaterOrEqual(tb, v.SchemaLevel, 2, "HEAD knows level 2 (pool-max-blocks) at least")
	return v.SchemaLevel
}

// requireAgentVersions awaits kvipamctl version showing each node's
// agent at want's version (the node record the agent writes as it
// starts), and no other node.
func (c *kcluster) requireAgentVersions(tb testing.TB, want map[string]string) {
	tb.Helper()
	require.NoError(tb, waitFor(time.Minute, fmt.Sprintf("agents at %v", want), func() error {
		cl, err := c.clusterLevel()
		if err != nil {
			return err
		}
		got := map[string]string{}
		for _, n := range cl.Nodes {
			got[n.Name] = n.Version
		}
		if !maps.Equal(got, want) {
			return fmt.Errorf("kvipamctl version: %+v", cl.Nodes)
		}
		return nil
	}))
}

// requireLevel awaits the cluster's schema level and whether a
// downgrade holds it (the agents raise it as they see the node records).
func (c *kcluster) requireLevel(tb testing.TB, step string, level int, held bool) {
	tb.Helper()
	require.NoError(tb, waitFor(time.Minute, fmt.Sprintf("%s: the cluster's level %d (held %v)", step, level, held), func() error {
		cl, err := c.clusterLevel()
		if err != nil {
			return err
		}
		if cl.Level != level || cl.Downgrade != held {
			return fmt.Errorf("kvipamctl version: level %d, held %v", cl.Level, cl.Downgrade)
		}
		return nil
	}))
}

// workload is what must not notice the roll: two target pods, a pinger on
// each node pinging the other node's target, and a sticky StatefulSet pod.
type workload struct {
	ns      string
	pods    map[string]pod // by name, as first Ready
	pingers []string
	sticky  pod // db-0, as last re-created
	sent    map[string]int
}

func pingerSpec(ns, name, node string, targets []string) string {
	spec := podTemplateSpec(node)
	spec["containers"].([]any)[0].(map[string]any)["command"] = append([]string{"/kt", "ping-loop"}, targets...)
	b, _ := json.Marshal(map[string]any{
		"apiVersion": "v1", "kind": "Pod",
		"metadata": map[string]any{"name": name, "namespace": ns, "labels": map[string]string{"kt": "1"}},
		"spec":     spec,
	})
	return string(b)
}

func (c *kcluster) startWorkload(tb testing.TB, ns string) *workload {
	tb.Helper()
	w := &workload{ns: ns, pods: map[string]pod{}, sent: map[string]int{}}
	t1 := c.runPod(tb, ns, "t1", "n1", nil)
	t2 := c.runPod(tb, ns, "t2", "n2", nil)
	for _, p := range []struct {
		name, node string
		target     pod
	}{{"p1", "n1", t2}, {"p2", "n2", t1}} {
		_, err := c.kubectlIn(pingerSpec(ns, p.name, p.node, p.target.ips()), "create", "-f", "-")
		require.NoError(tb, err)
		w.pods[p.name] = c.waitPodReady(tb, ns, p.name)
		w.pingers = append(w.pingers, p.name)
		for _, ip := range p.target.ips() {
			require.NoError(tb, waitFor(2*time.Minute, p.name+" reaches "+ip, func() error {
				logs, err := c.kubectl("-n", ns, "logs", p.name)
				if err != nil {
					return err
				}
				if !strings.Contains(logs, "up "+ip+"\n") {
					return fmt.Errorf("log: %q", tail(logs, 300))
				}
				return nil
			}))
		}
	}
	w.pods["t1"], w.pods["t2"] = t1, t2
	for _, p := range w.pods {
		requireIPsIn(tb, p, "default")
	}
	sts := stickyStatefulSet(ns)
	b, err := json.Marshal(sts)
	require.NoError(tb, err)
	_, err = c.kubectlIn(string(b), "create", "-f", "-")
	require.NoError(tb, err)
	require.NoError(tb, waitFor(5*time.Minute, "db-0 created", func() error {
		_, err := c.getPod(ns, "db-0")
		return err
	}))
	w.sticky = c.waitPodReady(tb, ns, "db-0")
	requireIPsIn(tb, w.sticky, "default")
	for name, p := range w.pods {
		logf("%s/%s on %s: %v", ns, name, p.Spec.NodeName, p.ips())
	}
	logf("%s/db-0 (sticky) on %s: %v", ns, w.sticky.Spec.NodeName, w.sticky.ips())
	return w
}

var (
	lostLine = regexp.MustCompile(`(?m)^lost .*$`)
	sentLine = regexp.MustCompile(`(?m)^sent (\S+) (\d+) lost (\d+)$`)
)

// requireKept checks every pod as it was at the start (UID, addresses,
// Ready, no restart, its records), no echo lost so far, and that each
// pinger has gone on sending.
func (w *workload) requireKept(tb testing.TB, c *kcluster, step string) {
	tb.Helper()
	for name, before := range w.pods {
		after, err := c.getPod(w.ns, name)
		require.NoError(tb, err)
		require.Equal(tb, before.Metadata.UID, after.Metadata.UID, "%s: %s was not re-created", step, name)
		require.Equal(tb, before.ips(), after.ips(), "%s: %s kept its addresses", step, name)
		require.True(tb, after.ready(), "%s: %s is Ready", step, name)
		require.Equal(tb, 0, after.Status.ContainerStatuses[0].RestartCount, "%s: %s did not restart", step, name)
		c.requireRecords(tb, after)
	}
	for _, name := range w.pingers {
		logs, err := c.kubectl("-n", w.ns, "logs", name)
		require.NoError(tb, err)
		require.Empty(tb, lostLine.FindAllString(logs, -1), "%s: %s lost no echo", step, name)
		require.NotContains(tb, logs, "error ", "%s: %s pings on", step, name)
		for _, m := range sentLine.FindAllStringSubmatch(logs, -1) {
			n, _ := strconv.Atoi(m[2])
			w.sent[name+" "+m[1]] = max(w.sent[name+" "+m[1]], n)
		}
	}
	logf("%s: every pod kept its UID and addresses; echoes answered so far: %v", step, w.sent)
}

// moveSticky deletes the sticky pod with its node cordoned: the
// StatefulSet's controller re-creates it (a new UID) on the other node,
// and it keeps its addresses.
func (w *workload) moveSticky(tb testing.TB, c *kcluster, step string) {
	tb.Helper()
	first := w.sticky
	from := first.Spec.NodeName
	_, err := c.kubectl("cordon", from)
	require.NoError(tb, err)
	c.deletePod(tb, w.ns, "db-0")
	require.NoError(tb, waitFor(5*time.Minute, "db-0 re-created with a new UID", func() error {
		p, err := c.getPod(w.ns, "db-0")
		if err != nil {
			return err
		}
		if p.Metadata.UID == first.Metadata.UID {
			return fmt.Errorf("still the old pod")
		}
		return nil
	}))
	second := c.waitPodReady(tb, w.ns, "db-0")
	_, err = c.kubectl("uncordon", from)
	require.NoError(tb, err)
	require.NotEqual(tb, from, second.Spec.NodeName, "%s: db-0 re-created on the other node", step)
	require.Equal(tb, first.ips(), second.ips(), "%s: db-0 kept its addresses from %s to %s", step, from, second.Spec.NodeName)
	c.requireRecords(tb, second)
	w.sticky = second
	logf("%s: db-0 re-created on %s with %v", step, second.Spec.NodeName, second.ips())
}

// finish checks every pod once more, and that both pingers still ping
// both families: each reports more echoes answered than it had at the
// last step.
func (w *workload) finish(tb testing.TB, c *kcluster) {
	tb.Helper()
	w.requireKept(tb, c, "the end")
	require.Len(tb, w.sent, 4, "two pingers, two families each: %v", w.sent)
	last := maps.Clone(w.sent)
	require.NoError(tb, waitFor(time.Minute, "the pingers ping on", func() error {
		w.requireKept(tb, c, "the end")
		for key, n := range last {
			if w.sent[key] <= n {
				return fmt.Errorf("%s: %d answered, as at the last step", key, w.sent[key])
			}
		}
		return nil
	}))
}
