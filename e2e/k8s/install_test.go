package k8s

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The pools the ConfigMap seeds: default, and two more for the pool
// selection rules (a pod's annotation, a namespace's binding).
var pools = map[string][]string{
	"default": {"10.244.0.0/16", "fd00:244::/64"},
	"blue":    {"10.245.0.0/16", "fd00:245::/64"},
	"green":   {"10.246.0.0/16", "fd00:246::/64"},
}

// agentManifest is make image's rendered kvipam-agent.yaml with the
// ConfigMap edited as docs/kubernetes.md step 3 says: etcd by address,
// and the pools; and the datapath when c.datapath sets one.
func (c *kcluster) agentManifest() (string, error) {
	return c.editManifest(c.agentYAML, filepath.Join(c.dir, "kvipam-agent.yaml"))
}

// editManifest writes src (a release's rendered kvipam-agent.yaml) to out
// with agentManifest's edits.
func (c *kcluster) editManifest(src, out string) (string, error) {
	b, err := os.ReadFile(src)
	if err != nil {
		return "", err
	}
	s := string(b)
	oldEP := `endpoints: ["https://192.0.2.11:2379", "https://192.0.2.12:2379", "https://192.0.2.13:2379"]`
	oldPools := "    pools:\n    - name: default\n      cidrs: [\"10.244.0.0/16\", \"fd00:244::/64\"]\n      blockSizeV4: 26\n      blockSizeV6: 120\n"
	if !strings.Contains(s, oldEP) || !strings.Contains(s, oldPools) {
		return "", fmt.Errorf("%s: the ConfigMap's endpoints or pools are not as docs/kubernetes.md shows them", src)
	}
	s = strings.Replace(s, oldEP, fmt.Sprintf(`endpoints: [%q]`, etcdURL), 1)
	var np strings.Builder
	np.WriteString("    defaultPool: default\n    pools:\n")
	for _, name := range []string{"default", "blue", "green"} {
		fmt.Fprintf(&np, "    - name: %s\n      cidrs: [%q, %q]\n      blockSizeV4: 26\n      blockSizeV6: 120\n", name, pools[name][0], pools[name][1])
	}
	s = strings.Replace(s, oldPools, np.String(), 1)
	if c.datapath != "" && c.datapath != "auto" {
		const oldDP = "    datapath: auto\n"
		if !strings.Contains(s, oldDP) {
			return "", fmt.Errorf("%s: the ConfigMap's datapath is not as docs/kubernetes.md shows it", src)
		}
		s = strings.Replace(s, oldDP, "    datapath: "+c.datapath+"\n", 1)
	}
	if c.datapath == "routes" {
		// The routes datapath serves no host ports: portmap after kvipam,
		// as docs/kubernetes.md says (a release's conflist may have it
		// already).
		const bpfCaps = `"capabilities": {"ips": true, "io.kubernetes.cri.pod-annotations": true, "portMappings": true}
        }`
		s = strings.Replace(s, bpfCaps, `"capabilities": {"ips": true, "io.kubernetes.cri.pod-annotations": true}
        },
        {"type": "portmap", "capabilities": {"portMappings": true}}`, 1)
	}
	if c.noPortmap {
		// The conflist kvipam ships for its eBPF datapath, which serves
		// hostPort itself: kvipam alone (a manifest without portmap is
		// left as it is).
		const chained = "        },\n        {\"type\": \"portmap\", \"capabilities\": {\"portMappings\": true}}\n"
		s = strings.Replace(s, chained, "        }\n", 1)
		if strings.Contains(s, `"type": "portmap"`) {
			return "", fmt.Errorf("%s: the conflist chains portmap otherwise than docs/kubernetes.md shows it", src)
		}
	}
	return out, os.WriteFile(out, []byte(s), 0o644)
}

// install is docs/kubernetes.md's steps 2 to 6: the Secret, the edited
// ConfigMap and the DaemonSet applied, then the DaemonSet ready.
func (c *kcluster) install(tb testing.TB) {
	tb.Helper()
	if c.installed && !c.adoptInstall {
		return
	}
	c.installFrom(tb, c.agentYAML)
}

// installFrom is install with src as the rendered manifest (a release's).
func (c *kcluster) installFrom(tb testing.TB, src string) {
	tb.Helper()
	t0 := time.Now()
	p := func(n string) string { return filepath.Join(c.pki, n) }
	c.etcdAccess(tb)
	if _, err := c.kubectl("-n", "kube-system", "get", "secret", "kvipam-etcd-client"); err != nil {
		_, err := c.kubectl("-n", "kube-system", "create", "secret", "generic", "kvipam-etcd-client",
			"--from-file=ca.crt="+p("ca.crt"), "--from-file=tls.crt="+p("kvipam.crt"), "--from-file=tls.key="+p("kvipam.key"))
		require.NoError(tb, err)
	}
	manifest, err := c.editManifest(src, filepath.Join(c.dir, "kvipam-agent.yaml"))
	require.NoError(tb, err)
	_, err = c.kubectl("apply", "-f", manifest)
	require.NoError(tb, err)
	c.installed, c.adoptInstall = true, false
	c.waitDaemonSet(tb, "kvipam-agent")
	c.waitNodesReady(tb)
	logf("kvipam installed and ready in %s", time.Since(t0).Round(time.Millisecond))
}

// etcdAccess is step 1: kvipam's etcd role and user (read and write on
// /kvipam/ only; its certificate's CN is the user), with authentication
// turned on in this etcd shared with Kubernetes in docs/operations.md's
// safe order; then the API server still reaches etcd, and kvipam does.
func (c *kcluster) etcdAccess(tb testing.TB) {
	tb.Helper()
	if c.etcdAuth {
		return
	}
	p := func(n string) string { return filepath.Join(c.pki, n) }
	argv := c.inRouter(filepath.Join(c.bin, "etcdauth"), "--endpoint", etcdURL, "--cacert", p("ca.crt"),
		"--cert", p("apiserver-etcd.crt"), "--key", p("apiserver-etcd.key"), "--root-password", "kvipam-test-root")
	out, err := run(argv[0], argv[1:]...)
	require.NoError(tb, err)
	c.etcdAuth = true
	logf("etcd authentication on:\n%s", out)
	_, err = c.kubectl("get", "--raw=/readyz/etcd")
	require.NoError(tb, err, "the API server reaches etcd as its certificate's user")
	_, err = c.kvipamctl("check")
	require.NoError(tb, err, "kvipamctl reaches etcd as user kvipam")
	argv = c.inRouter(filepath.Join(c.bin, "etcdauth"), "--endpoint", etcdURL, "--cacert", p("ca.crt"),
		"--cert", p("kvipam.crt"), "--key", p("kvipam.key"), "--check-user")
	out, err = run(argv[0], argv[1:]...)
	require.NoError(tb, err)
	require.Contains(tb, out, "/kvipam/: <nil>", "user kvipam reads /kvipam/")
	require.Contains(tb, out, "/registry/: etcdserver: permission denied", "user kvipam is refused /registry/")
}

// waitDaemonSet waits until the DaemonSet's current generation is ready
// on both nodes.
func (c *kcluster) waitDaemonSet(tb testing.TB, name string) {
	tb.Helper()
	_, err := c.kubectl("-n", "kube-system", "rollout", "status", "ds/"+name, "--timeout", "5m")
	if err != nil {
		out, _ := c.kubectl("-n", "kube-system", "get", "pods", "-o", "wide")
		ev, _ := c.kubectl("-n", "kube-system", "get", "events")
		tb.Fatalf("DaemonSet %s not ready: %v\n%s\n%s", name, err, out, tail(ev, 4000))
	}
	var ds struct {
		Status struct {
			Desired int `json:"desiredNumberScheduled"`
			Ready   int `json:"numberReady"`
		} `json:"status"`
	}
	out, err := c.kubectl("-n", "kube-system", "get", "ds", name, "-o", "json")
	require.NoError(tb, err)
	require.NoError(tb, json.Unmarshal([]byte(out), &ds))
	require.Equal(tb, 2, ds.Status.Desired, "the DaemonSet is scheduled on both nodes")
	require.Equal(tb, 2, ds.Status.Ready)
}

func (c *kcluster) waitNodesReady(tb testing.TB) {
	tb.Helper()
	_, err := c.kubectl("wait", "--for=condition=Ready", "node/n1", "node/n2", "--timeout", "5m")
	require.NoError(tb, err, "nodes Ready once the network is installed")
}

// uninstall is docs/kubernetes.md's "Uninstalling", steps 1 to 3 (the
// caller deleted its pods).
func (c *kcluster) uninstall(tb testing.TB) {
	tb.Helper()
	manifest := filepath.Join(c.dir, "kvipam-agent.yaml")
	_, err := c.kubectl("delete", "-f", manifest, "--wait=true", "--timeout", "5m")
	require.NoError(tb, err)
	_, err = c.kubectl("apply", "-f", c.uninstallYML)
	require.NoError(tb, err)
	_, err = c.kubectl("-n", "kube-system", "rollout", "status", "ds/kvipam-uninstall", "--timeout", "5m")
	require.NoError(tb, err)
	_, err = c.kubectl("delete", "-f", c.uninstallYML, "--wait=true", "--timeout", "5m")
	require.NoError(tb, err)
	c.installed = false
}

// podSpec is a test pod: the kt image sleeping, on node (if not empty),
// with annotations.
func podSpec(ns, name, node string, annotations map[string]string) string {
	m := map[string]any{
		"apiVersion": "v1", "kind": "Pod",
		"metadata": map[string]any{"name": name, "namespace": ns, "annotations": annotations, "labels": map[string]string{"kt": "1"}},
		"spec":     podTemplateSpec(node),
	}
	b, _ := json.Marshal(m)
	return string(b)
}

// podSpecNet is a test pod without annotations, in the host's network
// namespace when hostNet.
func podSpecNet(ns, name, node string, hostNet bool) string {
	spec := podTemplateSpec(node)
	if hostNet {
		spec["hostNetwork"] = true
	}
	m := map[string]any{
		"apiVersion": "v1", "kind": "Pod",
		"metadata": map[string]any{"name": name, "namespace": ns, "labels": map[string]string{"kt": "1"}},
		"spec":     spec,
	}
	b, _ := json.Marshal(m)
	return string(b)
}

// stickyStatefulSet is StatefulSet db of one pod in ns, whose pods keep
// their addresses across re-creation (kvipam.io/sticky, 10 minutes).
func stickyStatefulSet(ns string) map[string]any {
	return map[string]any{
		"apiVersion": "apps/v1", "kind": "StatefulSet",
		"metadata": map[string]any{"name": "db", "namespace": ns},
		"spec": map[string]any{
			"serviceName": "db", "replicas": 1,
			"selector": map[string]any{"matchLabels": map[string]string{"app": "db"}},
			"template": map[string]any{
				"metadata": map[string]any{"labels": map[string]string{"app": "db"}, "annotations": map[string]string{"kvipam.io/sticky": "10m"}},
				"spec":     podTemplateSpec(""),
			},
		},
	}
}

func podTemplateSpec(node string) map[string]any {
	spec := map[string]any{
		"terminationGracePeriodSeconds": 2,
		"automountServiceAccountToken":  false,
		"containers": []any{map[string]any{
			"name": "kt", "image": ktRef, "imagePullPolicy": "Never", "command": []string{"/kt", "sleep"},
		}},
	}
	if node != "" {
		spec["nodeSelector"] = map[string]string{"kubernetes.io/hostname": node}
	}
	return spec
}

func (c *kcluster) ensureNamespace(tb testing.TB, ns string) {
	tb.Helper()
	if _, err := c.kubectl("get", "namespace", ns); err == nil {
		return
	}
	_, err := c.kubectl("create", "namespace", ns)
	require.NoError(tb, err)
	// The namespace's default service account (pods wait for it).
	require.NoError(tb, waitFor(2*time.Minute, "service account in "+ns, func() error {
		_, err := c.kubectl("-n", ns, "get", "serviceaccount", "default")
		return err
	}))
}

// runPod creates a pod and waits until it is Ready; it returns the pod.
func (c *kcluster) runPod(tb testing.TB, ns, name, node string, annotations map[string]string) pod {
	tb.Helper()
	c.ensureNamespace(tb, ns)
	_, err := c.kubectlIn(podSpec(ns, name, node, annotations), "create", "-f", "-")
	require.NoError(tb, err)
	return c.waitPodReady(tb, ns, name)
}

func (c *kcluster) waitPodReady(tb testing.TB, ns, name string) pod {
	tb.Helper()
	if _, err := c.kubectl("-n", ns, "wait", "--for=condition=Ready", "pod/"+name, "--timeout", "5m"); err != nil {
		desc, _ := c.kubectl("-n", ns, "describe", "pod", name)
		tb.Fatalf("pod %s/%s not Ready: %v\n%s", ns, name, err, tail(desc, 4000))
	}
	p, err := c.getPod(ns, name)
	require.NoError(tb, err)
	return p
}

func (c *kcluster) deletePod(tb testing.TB, ns, name string) {
	tb.Helper()
	_, err := c.kubectl("-n", ns, "delete", "pod", name, "--wait=true", "--timeout", "5m")
	require.NoError(tb, err)
}

// ping execs kt ping in pod ns/name towards addr (through the API server
// and the pod's kubelet).
func (c *kcluster) ping(ns, name, addr string) error {
	_, err := c.kubectl("-n", ns, "exec", name, "--", "/kt", "ping", addr)
	return err
}

// requireIPsIn checks that a pod has one IPv4 and one IPv6 address, both
// in pool's CIDRs.
func requireIPsIn(tb testing.TB, p pod, pool string) (v4, v6 netip.Addr) {
	tb.Helper()
	ips := p.ips()
	require.Len(tb, ips, 2, "pod %s/%s has an IPv4 and an IPv6 address: %v", p.Metadata.Namespace, p.Metadata.Name, ips)
	for _, s := range ips {
		a, err := netip.ParseAddr(s)
		require.NoError(tb, err)
		in := false
		for _, cidr := range pools[pool] {
			if netip.MustParsePrefix(cidr).Contains(a) {
				in = true
			}
		}
		require.True(tb, in, "pod %s/%s's address %s is in pool %s %v", p.Metadata.Namespace, p.Metadata.Name, a, pool, pools[pool])
		if a.Is4() {
			v4 = a
		} else {
			v6 = a
		}
	}
	require.True(tb, v4.IsValid() && v6.IsValid(), "one address of each family: %v", ips)
	return v4, v6
}

// recordsOf is etcd's allocation records naming pod ns/name.
func (c *kcluster) recordsOf(tb testing.TB, ns, name string) []ipRecord {
	tb.Helper()
	recs, err := c.ipRecords()
	require.NoError(tb, err)
	var mine []ipRecord
	for _, r := range recs {
		if r.Namespace == ns && r.Pod == name {
			mine = append(mine, r)
		}
	}
	return mine
}

// requireRecords checks that etcd's records of p's addresses name its
// namespace, name and current UID, and its node.
func (c *kcluster) requireRecords(tb testing.TB, p pod) {
	tb.Helper()
	recs := c.recordsOf(tb, p.Metadata.Namespace, p.Metadata.Name)
	got := map[string]ipRecord{}
	for _, r := range recs {
		got[r.IP] = r
	}
	for _, ip := range p.ips() {
		r, ok := got[ip]
		require.True(tb, ok, "etcd has a record of %s/%s's address %s: %+v", p.Metadata.Namespace, p.Metadata.Name, ip, recs)
		require.Equal(tb, p.Metadata.UID, r.PodUID, "the record of %s names the pod's current UID", ip)
		require.Equal(tb, p.Spec.NodeName, r.Node)
		require.Equal(tb, "allocated", r.State)
	}
	require.Len(tb, recs, len(p.ips()), "no other record names %s/%s: %+v", p.Metadata.Namespace, p.Metadata.Name, recs)
}

// waitNoRecords waits until etcd has no record naming ns/name (the DEL
// is asynchronous to the API's delete).
func (c *kcluster) waitNoRecords(tb testing.TB, ns, name string) {
	tb.Helper()
	require.NoError(tb, waitFor(3*time.Minute, "no record of "+ns+"/"+name, func() error {
		if recs := c.recordsOf(tb, ns, name); len(recs) > 0 {
			return fmt.Errorf("records: %+v", recs)
		}
		return nil
	}))
}
