package k8s

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// --- whereabouts: the real plugin, its CRDs and its kubeconfig ---

const (
	// whereaboutsPkg is the plugin's main package in its module, which
	// whereabouts/go.mod pins (v0.9.2).
	whereaboutsPkg = "github.com/k8snetworkplumbingwg/whereabouts/cmd"
	whereaboutsMod = "github.com/k8snetworkplumbingwg/whereabouts"
	// whereaboutsKubeconfig is where whereabouts' installer
	// (script/lib.sh) writes the plugin's kubeconfig on a node, and the
	// flat file beside it that names it.
	whereaboutsKubeconfig = "/etc/cni/net.d/whereabouts.d/whereabouts.kubeconfig"
	whereaboutsConf       = "/etc/cni/net.d/whereabouts.d/whereabouts.conf"
	// whereaboutsObjects is what an export for kvipamctl import
	// whereabouts --file holds.
	whereaboutsObjects = "ippools.whereabouts.cni.cncf.io,overlappingrangeipreservations.whereabouts.cni.cncf.io"
)

// whereaboutsNet is an old network on bridge with whereabouts: a range
// per node (one IPPool each), the bridge's gateway kept out of it.
func whereaboutsNet(pool, prefix string) *oldNet {
	o := &oldNet{pool: pool, cidrs: []string{prefix + ".0.0/16"},
		ranges: map[string][]string{"n1": {prefix + ".1.0/24"}, "n2": {prefix + ".2.0/24"}},
		gws:    map[string][]string{"n1": {prefix + ".1.1"}, "n2": {prefix + ".2.1"}}}
	o.ipam = func(node string) map[string]any {
		r := o.ranges[node][0]
		base := strings.TrimSuffix(r, ".0/24")
		return map[string]any{"type": "whereabouts", "range": r, "range_start": base + ".10", "gateway": o.gws[node][0],
			"kubernetes": map[string]string{"kubeconfig": whereaboutsKubeconfig}}
	}
	return o
}

// installWhereabouts puts whereabouts on the cluster as its
// daemonset-install.yaml does, but for the DaemonSet (whose image is not
// here): its CRDs from the module's source, its ServiceAccount, ClusterRole
// and binding; on each node its kubeconfig with the ServiceAccount's token
// and the flat file naming it (script/lib.sh's generateKubeConfig and
// generateWhereaboutsConf). The plugin binary is copied with the old
// network (startOldNet).
func (c *kcluster) installWhereabouts(tb testing.TB) {
	tb.Helper()
	if c.whereabouts {
		return
	}
	cmd := exec.Command("go", "-C", "whereabouts", "list", "-m", "-f", "{{.Dir}}", whereaboutsMod)
	dirb, err := cmd.Output()
	require.NoError(tb, err, "find whereabouts' module source")
	dir := strings.TrimSpace(string(dirb))
	for _, f := range []string{"whereabouts.cni.cncf.io_ippools.yaml", "whereabouts.cni.cncf.io_overlappingrangeipreservations.yaml",
		"whereabouts.cni.cncf.io_nodeslicepools.yaml"} {
		_, err := c.kubectl("apply", "-f", filepath.Join(dir, "doc", "crds", f))
		require.NoError(tb, err)
	}
	// daemonset-install.yaml's RBAC: its documents before the ConfigMap.
	b, err := os.ReadFile(filepath.Join(dir, "doc", "crds", "daemonset-install.yaml"))
	require.NoError(tb, err)
	var rbac []string
	for _, d := range strings.Split(string(b), "\n---") {
		if strings.Contains(d, "kind: ServiceAccount") || strings.Contains(d, "kind: ClusterRole") {
			rbac = append(rbac, d)
		}
	}
	require.Len(tb, rbac, 3, "daemonset-install.yaml's ServiceAccount, ClusterRoleBinding and ClusterRole")
	_, err = c.kubectlIn(strings.Join(rbac, "\n---\n"), "apply", "-f", "-")
	require.NoError(tb, err)
	_, err = c.kubectl("wait", "--for=condition=Established", "crd/ippools.whereabouts.cni.cncf.io",
		"crd/overlappingrangeipreservations.whereabouts.cni.cncf.io", "--timeout", "2m")
	require.NoError(tb, err)
	token, err := c.kubectl("-n", "kube-system", "create", "token", "whereabouts", "--duration", "24h")
	require.NoError(tb, err)
	ca, err := os.ReadFile(filepath.Join(c.pki, "ca.crt"))
	require.NoError(tb, err)
	kc := fmt.Sprintf(`# Kubeconfig file for the Whereabouts CNI plugin.
apiVersion: v1
kind: Config
clusters:
- name: local
  cluster:
    server: %s
    certificate-authority-data: %s
users:
- name: whereabouts
  user:
    token: "%s"
contexts:
- name: whereabouts-context
  context:
    cluster: local
    user: whereabouts
    namespace: kube-system
current-context: whereabouts-context
`, apiURL, base64.StdEncoding.EncodeToString(ca), strings.TrimSpace(token))
	conf := fmt.Sprintf(`{"datastore": "kubernetes", "kubernetes": {"kubeconfig": %q}, "reconciler_cron_expression": "30 4 * * *"}`, whereaboutsKubeconfig)
	for _, n := range c.nodes {
		require.NoError(tb, c.writeNodeFile(n, whereaboutsKubeconfig, kc, 0o600))
		require.NoError(tb, c.writeNodeFile(n, whereaboutsConf, conf, 0o600))
	}
	c.whereabouts = true
}

// whereaboutsState is whereabouts' objects (IPPools and overlapping range
// reservations), each as name, resourceVersion and spec: what an import
// must leave untouched.
func (c *kcluster) whereaboutsState(tb testing.TB) map[string]string {
	tb.Helper()
	out, err := c.kubectl("get", whereaboutsObjects, "-A", "-o", "json")
	require.NoError(tb, err)
	var l struct {
		Items []struct {
			Kind     string `json:"kind"`
			Metadata struct {
				Name            string `json:"name"`
				Namespace       string `json:"namespace"`
				ResourceVersion string `json:"resourceVersion"`
			} `json:"metadata"`
			Spec json.RawMessage `json:"spec"`
		} `json:"items"`
	}
	require.NoError(tb, json.Unmarshal([]byte(out), &l))
	m := map[string]string{}
	for _, it := range l.Items {
		m[it.Kind+" "+it.Metadata.Namespace+"/"+it.Metadata.Name] = it.Metadata.ResourceVersion + " " + string(it.Spec)
	}
	return m
}

// exportWhereabouts writes what kvipamctl import whereabouts --file
// reads: whereabouts' objects and the pods, as kubectl prints them.
func (c *kcluster) exportWhereabouts(tb testing.TB) string {
	tb.Helper()
	out, err := c.kubectl("get", whereaboutsObjects+",pods", "-A", "-o", "json")
	require.NoError(tb, err)
	path := filepath.Join(c.dir, fmt.Sprintf("whereabouts-export-%d.json", time.Now().UnixNano()))
	require.NoError(tb, os.WriteFile(path, []byte(out), 0o600))
	return path
}

// importWhereabouts runs kvipamctl import whereabouts into pool from the
// API server (admin's kubeconfig) or, with file, an export; a dry run
// when dry, printing JSON when asJSON.
func (c *kcluster) importWhereabouts(tb testing.TB, pool, file string, dry, asJSON bool) string {
	tb.Helper()
	args := []string{"import", "whereabouts", "--pool", pool}
	if asJSON {
		args = append([]string{"-o", "json"}, args...)
	}
	if file != "" {
		args = append(args, "--file", file)
	} else {
		args = append(args, "--kubeconfig", c.kubecfg)
	}
	if dry {
		args = append(args, "--dry-run")
	}
	out, err := c.kvipamctl(args...)
	require.NoError(tb, err, "kvipamctl %s: %s", strings.Join(args, " "), out)
	return out
}

// TestK8sAdoptFromWhereabouts: TestK8sAdoptFromHostLocal's run with
// whereabouts as the old IPAM (IPv4, a range per node: an IPPool each),
// imported through the API server.
func TestK8sAdoptFromWhereabouts(t *testing.T) {
	c := cluster(t)
	c.installWhereabouts(t)
	a := &adoption{ns: "k8s-adopt-wb", net: whereaboutsNet("adopt-wb", "10.248"), plugins: []string{"whereabouts"}, withPod: true}
	a.importFn = func(tb testing.TB, dry, asJSON bool) string {
		return c.importWhereabouts(tb, a.net.pool, "", dry, asJSON)
	}
	a.source = func(string) string { return "whereabouts:" + a.net.pool }
	a.finalize = func(tb testing.TB) { c.finalizeWhereabouts(tb, a.net.pool) }
	c.runAdoption(t, a)
}

// TestImportWhereabouts: pods on bridge with the real whereabouts (its
// CRDs on the API server, its kubeconfig on each node, run by the
// kubelets' containerd), then kvipamctl import whereabouts: a dry run
// from the API server and one from an export file print the plan (every
// address, its pod) and write nothing; the import from the export makes
// every live whereabouts allocation a kvipam record owned by the same
// sandbox and interface and naming the pod; importing again from the API
// server changes nothing; whereabouts' IPPools and reservations are
// untouched (resource versions and specs) through the import, the switch
// and the old pods' DELs, until kvipamctl import finalize.
func TestImportWhereabouts(t *testing.T) {
	c := cluster(t)
	c.installWhereabouts(t)
	o := whereaboutsNet("import-wb", "10.249")
	const ns = "k8s-import-wb"
	c.startOldNet(t, o, "whereabouts")
	t.Cleanup(func() { c.deleteNamespace(t, ns) })
	old := []pod{c.runOldPod(t, o, ns, "wb-a1", "n1"), c.runOldPod(t, o, ns, "wb-a2", "n1"), c.runOldPod(t, o, ns, "wb-b1", "n2")}
	atts := map[string]cniAttachment{}
	ids := map[string]bool{}
	for _, p := range old {
		require.Len(t, p.ips(), 1, "%s: an IPv4 address from whereabouts", p.Metadata.Name)
		atts[p.Metadata.Name] = c.attachmentOf(t, p)
		ids[atts[p.Metadata.Name].ContainerID] = true
	}
	c.installForAdoption(t)
	c.ensurePool(t, o)
	before := c.whereaboutsState(t)
	t.Logf("whereabouts' objects: %d", len(before))
	for k, v := range before {
		if strings.HasPrefix(k, "IPPool ") {
			t.Logf("%s: %s", k, v)
		}
	}

	// Dry runs: from the API server, and from an export.
	requirePlan := func(what, table, plan string) {
		t.Logf("%s:\n%s", what, strings.TrimSpace(table))
		for _, p := range old {
			require.Contains(t, plan, fmt.Sprintf(`"ip": %q`, p.ips()[0]), "%s (-o json) names %s's address", what, p.Metadata.Name)
			require.Contains(t, plan, fmt.Sprintf(`"pod": %q`, p.Metadata.Name), "%s (-o json) names pod %s", what, p.Metadata.Name)
			require.Contains(t, plan, atts[p.Metadata.Name].ContainerID, "%s (-o json) names %s's sandbox", what, p.Metadata.Name)
		}
		require.Empty(t, c.recordsOwnedBy(t, ids), "%s writes nothing", what)
	}
	requirePlan("the dry run from the API server", c.importWhereabouts(t, o.pool, "", true, false), c.importWhereabouts(t, o.pool, "", true, true))
	file := c.exportWhereabouts(t)
	requirePlan("the dry run from an export", c.importWhereabouts(t, o.pool, file, true, false), c.importWhereabouts(t, o.pool, file, true, true))

	// The import from the export, then again from the API server.
	out := c.importWhereabouts(t, o.pool, file, false, false)
	t.Logf("the import from the export:\n%s", strings.TrimSpace(out))
	for _, p := range old {
		c.requireImported(t, o.pool, "whereabouts:"+o.pool, p, atts[p.Metadata.Name], true)
	}
	first := c.recordsOwnedBy(t, ids)
	require.Len(t, first, len(old))
	out = c.importWhereabouts(t, o.pool, "", false, false)
	t.Logf("the import again, from the API server:\n%s", strings.TrimSpace(out))
	require.ElementsMatch(t, first, c.recordsOwnedBy(t, ids), "importing again changes nothing")
	require.Equal(t, before, c.whereaboutsState(t), "the import leaves whereabouts' objects untouched")
	out, err := c.kvipamctl("check")
	require.NoError(t, err, "kvipamctl check after the import: %s", out)

	// The switch, the old pods' DELs (kvipam's now): their records go,
	// whereabouts' objects stay as they were.
	for _, n := range c.nodes {
		c.switchNode(t, o, n)
	}
	for _, p := range old {
		c.deletePod(t, ns, p.Metadata.Name)
	}
	require.NoError(t, waitFor(3*time.Minute, "no imported record left", func() error {
		if recs := c.recordsOwnedBy(t, ids); len(recs) > 0 {
			return fmt.Errorf("records of old pods: %+v", recs)
		}
		return nil
	}))
	require.Equal(t, before, c.whereaboutsState(t), "whereabouts' objects untouched until finalize")
	status, err := c.kvipamctl("import", "status")
	require.NoError(t, err)
	t.Logf("kvipamctl import status:\n%s", strings.TrimSpace(status))
	c.finalizeWhereabouts(t, o.pool)
	t.Logf("whereabouts' objects after finalize: %d (before: %d)", len(c.whereaboutsState(t)), len(before))
	out, err = c.kvipamctl("check")
	require.NoError(t, err, "kvipamctl check after finalize: %s", out)
}

// finalizeWhereabouts runs kvipamctl import finalize of pool's
// whereabouts import, which leaves whereabouts' objects as they are;
// then deletes them, as the operator does once every import is
// finalized.
func (c *kcluster) finalizeWhereabouts(tb testing.TB, pool string) {
	tb.Helper()
	before := c.whereaboutsState(tb)
	out, err := c.kvipamctl("import", "finalize", "whereabouts:"+pool)
	require.NoError(tb, err, "kvipamctl import finalize whereabouts:%s: %s", pool, out)
	tb.Logf("kvipamctl import finalize whereabouts:%s:\n%s", pool, strings.TrimSpace(out))
	require.Equal(tb, before, c.whereaboutsState(tb), "finalize writes nothing to the Kubernetes API")
	// Then the operator deletes whereabouts' objects (docs/kubernetes.md,
	// step 6): they still list the old pods, whose DELs went to kvipam.
	_, err = c.kubectl("-n", "kube-system", "delete", whereaboutsObjects, "--all")
	require.NoError(tb, err)
}
