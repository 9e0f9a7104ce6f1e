package k8s

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// --- adoption: a cluster running another IPAM, taken over by kvipam ---
//
// The old network is what a cluster without kvipam runs: the reference
// bridge plugin on a bridge of each node (cni-adopt, the nodes' gateway
// for their pods), its addresses from the real host-local (a range per
// node) or the real whereabouts (its IPPools through the API server), and
// the nodes routing each other's ranges (the test plays the routing
// daemon: a route per range in each node's namespace). Its conflist,
// 00-adopt.conflist, sorts before kvipam's 10-kvipam.conflist, so it is
// the node's network (containerd reads the first one) whether or not
// kvipam's DaemonSet installed its own. The switch rewrites it in place,
// keeping the network's name: bridge stays, ipam becomes kvipam-ipam.

const (
	adoptConf   = "00-adopt.conflist"
	adoptNet    = "adopt" // the network's name, kept by the switch
	adoptBridge = "cni-adopt"
	// adoptEvery is the old pods' ping interval.
	adoptEvery = 20 * time.Millisecond
)

// oldNet is one adoption test's old network.
type oldNet struct {
	pool   string              // kvipam's pool the import fills
	cidrs  []string            // its CIDRs
	ranges map[string][]string // the node's old subnets, by node
	gws    map[string][]string // the bridge's gateway addresses, by node
	// ipam is the old IPAM plugin's configuration on node.
	ipam func(node string) map[string]any
}

// conflist is the old network's conflist on node, or with kvipam-ipam
// (the switch) when switched.
func (o *oldNet) conflist(node string, switched bool) string {
	br := map[string]any{"type": "bridge", "bridge": adoptBridge, "isDefaultGateway": true, "ipam": o.ipam(node)}
	if switched {
		// deploy/cni/README.md's bridge with kvipam-ipam: the bridge puts
		// no block's address on itself; the pods route through
		// 169.254.1.1 and fe80::ecee:eeff:feee:eeee, which the node put
		// on the bridge (switchNode).
		br = map[string]any{"type": "bridge", "bridge": adoptBridge, "isGateway": false, "ipam": map[string]any{
			"type": "kvipam-ipam", "pool": o.pool, "agentSocket": "/run/kvipam/agent.sock", "delQueueDir": "/var/lib/kvipam/del-queue"}}
	}
	b, _ := json.MarshalIndent(map[string]any{"cniVersion": "1.0.0", "name": adoptNet, "plugins": []any{br}}, "", "  ")
	return string(b)
}

// inNodeRun runs argv in node n's mount and network namespaces.
func (c *kcluster) inNodeRun(n *knode, args ...string) (string, error) {
	argv := c.inNode(n, args...)
	return run(argv[0], argv[1:]...)
}

// writeNodeFile writes content to path in node n, atomically: a
// temporary name in the same directory (not a conflist's extension, so
// containerd never reads it half-written), then a rename.
func (c *kcluster) writeNodeFile(n *knode, path, content string, perm os.FileMode) error {
	src := filepath.Join(c.dir, n.name+"-"+filepath.Base(path))
	if err := os.WriteFile(src, []byte(content), perm); err != nil {
		return err
	}
	tmp := filepath.Join(filepath.Dir(path), "."+filepath.Base(path)+".tmp")
	if _, err := c.inNodeRun(n, "mkdir", "-p", filepath.Dir(path)); err != nil {
		return err
	}
	if _, err := c.inNodeRun(n, "cp", src, tmp); err != nil {
		return err
	}
	_, err := c.inNodeRun(n, "mv", "-f", tmp, path)
	return err
}

// startOldNet installs the old network on both nodes: the plugins in
// /opt/cni/bin (as the old network's own installer would), the routes
// between the nodes' ranges, and the conflist; then the nodes are Ready.
func (c *kcluster) startOldNet(tb testing.TB, o *oldNet, plugins ...string) {
	tb.Helper()
	tb.Cleanup(func() { c.stopOldNet(tb, o) })
	for _, n := range c.nodes {
		for _, p := range append([]string{"bridge", "loopback"}, plugins...) {
			src := filepath.Join(c.bin, p)
			if _, err := os.Stat(src); err != nil {
				src = filepath.Join(c.kbin, p)
			}
			_, err := c.inNodeRun(n, "cp", src, "/opt/cni/bin/"+p)
			require.NoError(tb, err)
		}
		for _, m := range c.nodes {
			if m == n {
				continue
			}
			for _, r := range o.ranges[m.name] {
				via := m.ip
				if netip.MustParsePrefix(r).Addr().Is6() {
					via = m.ip6
				}
				_, err := run("ip", "-n", n.netns, "route", "replace", r, "via", via)
				require.NoError(tb, err)
			}
		}
		require.NoError(tb, c.writeNodeFile(n, "/etc/cni/net.d/"+adoptConf, o.conflist(n.name, false), 0o644))
	}
	c.waitNodesReady(tb)
}

// stopOldNet removes what startOldNet and switchNode put on the nodes:
// the conflist, the routes and the bridge (the old pods are gone).
func (c *kcluster) stopOldNet(tb testing.TB, o *oldNet) {
	tb.Helper()
	for _, n := range c.nodes {
		_, _ = c.inNodeRun(n, "rm", "-f", "/etc/cni/net.d/"+adoptConf)
		for _, m := range c.nodes {
			for _, r := range o.ranges[m.name] {
				_, _ = run("ip", "-n", n.netns, "route", "del", r)
			}
		}
		for _, r := range o.cidrs {
			_, _ = run("ip", "-n", n.netns, "route", "del", r, "dev", adoptBridge)
		}
		_, _ = run("ip", "-n", n.netns, "link", "del", adoptBridge)
	}
}

// switchNode is the switch on node n: the conflist rewritten in place,
// then the bridge prepared for kvipam-ipam's pods as deploy/cni/README.md
// says (the link-local gateways on it, the pool's CIDRs routed to it: the
// node's own blocks are on the bridge, other nodes' blocks have the
// agent's more specific routes); not before, as docs/operations.md says:
// an ADD under the old conflist (bridge with isGateway) refuses a bridge
// with another address.
func (c *kcluster) switchNode(tb testing.TB, o *oldNet, n *knode) {
	tb.Helper()
	require.NoError(tb, c.writeNodeFile(n, "/etc/cni/net.d/"+adoptConf, o.conflist(n.name, true), 0o644))
	for _, a := range [][]string{
		{"addr", "replace", "169.254.1.1/32", "dev", adoptBridge},
		{"addr", "replace", "fe80::ecee:eeff:feee:eeee/64", "dev", adoptBridge},
	} {
		_, err := run("ip", append([]string{"-n", n.netns}, a...)...)
		require.NoError(tb, err)
	}
	for _, r := range o.cidrs {
		_, err := run("ip", "-n", n.netns, "route", "replace", r, "dev", adoptBridge)
		require.NoError(tb, err)
	}
}

// installForAdoption installs kvipam's agents in an adoption's order
// (docs/kubernetes.md, "Adopting a running cluster"): the DaemonSet's
// init container installs the plugins but no conflist (install-cni
// --conflist ""), so the node keeps its old network while the agents
// start and the import runs. A later install (another test's) applies the
// manifest as it is, which installs kvipam's conflist. If kvipam is
// installed already, its conflist sorts after the old network's, which
// stays the node's.
func (c *kcluster) installForAdoption(tb testing.TB) {
	tb.Helper()
	if c.installed {
		return
	}
	p := func(n string) string { return filepath.Join(c.pki, n) }
	c.etcdAccess(tb)
	if _, err := c.kubectl("-n", "kube-system", "get", "secret", "kvipam-etcd-client"); err != nil {
		_, err := c.kubectl("-n", "kube-system", "create", "secret", "generic", "kvipam-etcd-client",
			"--from-file=ca.crt="+p("ca.crt"), "--from-file=tls.crt="+p("kvipam.crt"), "--from-file=tls.key="+p("kvipam.key"))
		require.NoError(tb, err)
	}
	manifest, err := c.editManifest(c.agentYAML, filepath.Join(c.dir, "kvipam-agent.yaml"))
	require.NoError(tb, err)
	b, err := os.ReadFile(manifest)
	require.NoError(tb, err)
	const withConf = `"--conflist", "/etc/kvipam/cni/10-kvipam.conflist"]`
	require.Contains(tb, string(b), withConf, "the init container's command is as docs/kubernetes.md shows it")
	adopt := filepath.Join(c.dir, "kvipam-agent-adopt.yaml")
	require.NoError(tb, os.WriteFile(adopt, []byte(strings.Replace(string(b), withConf, `"--conflist", ""]`, 1)), 0o644))
	_, err = c.kubectl("apply", "-f", adopt)
	require.NoError(tb, err)
	c.installed, c.adoptInstall = true, true
	c.waitDaemonSet(tb, "kvipam-agent")
	for _, n := range c.nodes {
		out, err := c.inNodeRun(n, "ls", "/etc/cni/net.d", "/opt/cni/bin")
		require.NoError(tb, err)
		require.NotContains(tb, out, "10-kvipam.conflist", "node %s: no kvipam conflist before the switch", n.name)
		require.Contains(tb, out, "kvipam-ipam", "node %s: the plugins installed", n.name)
	}
}

// kvipamctlOn runs kvipamctl on node n (where host-local's files are).
func (c *kcluster) kvipamctlOn(n *knode, args ...string) (string, error) {
	p := func(n string) string { return filepath.Join(c.pki, n) }
	return c.inNodeRun(n, append([]string{filepath.Join(c.bin, "kvipamctl"), "--endpoints", etcdURL,
		"--cacert", p("ca.crt"), "--cert", p("kvipam.crt"), "--key", p("kvipam.key"), "--timeout", "60s"}, args...)...)
}

// ensurePool creates pool o.pool in etcd and reserves the old bridges'
// gateway addresses in it: no old IPAM recorded them (host-local skips
// its gateway, whereabouts its gateway), and a pod given one would take
// the address the old pods route through.
func (c *kcluster) ensurePool(tb testing.TB, o *oldNet) {
	tb.Helper()
	args := []string{"pool", "create", o.pool}
	for _, cidr := range o.cidrs {
		args = append(args, "--cidr", cidr)
	}
	_, err := c.kvipamctl(args...)
	require.NoError(tb, err)
	for node, gws := range o.gws {
		for _, gw := range gws {
			out, err := c.kvipamctl("pool", "reserve", o.pool, gw, "--reason", "the old bridge's gateway on "+node)
			if err != nil && strings.Contains(err.Error(), "is reserved already") {
				continue // by an earlier run of the test on this cluster
			}
			require.NoError(tb, err, "%s", out)
		}
	}
}

// cniAttachment is a sandbox's attachment to the old network, as the
// runtime's CNI cache (libcni's, /var/lib/cni/results) keeps it.
type cniAttachment struct {
	ContainerID string     `json:"containerId"`
	IfName      string     `json:"ifName"`
	Network     string     `json:"networkName"`
	CNIArgs     [][]string `json:"cniArgs"`
}

func (a cniAttachment) arg(k string) string {
	for _, kv := range a.CNIArgs {
		if len(kv) == 2 && kv[0] == k {
			return kv[1]
		}
	}
	return ""
}

// attachmentOf is pod p's attachment to the old network, from its node's
// CNI cache: the container ID and interface the old IPAM recorded.
func (c *kcluster) attachmentOf(tb testing.TB, p pod) cniAttachment {
	tb.Helper()
	n := c.node(p.Spec.NodeName)
	require.NotNil(tb, n)
	out, err := c.inNodeRun(n, "sh", "-c", "cat /var/lib/cni/results/"+adoptNet+"-* 2>/dev/null; true")
	require.NoError(tb, err)
	dec := json.NewDecoder(strings.NewReader(out))
	for dec.More() {
		var a cniAttachment
		require.NoError(tb, dec.Decode(&a))
		if a.Network == adoptNet && a.arg("K8S_POD_NAMESPACE") == p.Metadata.Namespace && a.arg("K8S_POD_NAME") == p.Metadata.Name &&
			a.arg("K8S_POD_UID") == p.Metadata.UID {
			return a
		}
	}
	tb.Fatalf("no attachment of %s/%s to network %s in %s's CNI cache", p.Metadata.Namespace, p.Metadata.Name, adoptNet, n.name)
	return cniAttachment{}
}

// requireImported checks that every address of the old pod p has a
// kvipam record in pool owned by its attachment (container ID and
// interface), on its node, marked imported from source, naming the pod
// when withPod (the source knew it: whereabouts does, host-local does
// not).
func (c *kcluster) requireImported(tb testing.TB, pool, source string, p pod, a cniAttachment, withPod bool) {
	tb.Helper()
	recs, err := c.ipRecords()
	require.NoError(tb, err)
	byIP := map[string]ipRecord{}
	for _, r := range recs {
		byIP[r.IP] = r
	}
	for _, ip := range p.ips() {
		r, ok := byIP[ip]
		require.True(tb, ok, "kvipam has a record of %s/%s's address %s", p.Metadata.Namespace, p.Metadata.Name, ip)
		require.Equal(tb, pool, r.Pool, "%s", ip)
		require.Equal(tb, a.ContainerID, r.ContainerID, "the record of %s is owned by the pod's sandbox", ip)
		require.Equal(tb, a.IfName, r.IfName, "%s", ip)
		require.Equal(tb, p.Spec.NodeName, r.Node, "%s", ip)
		require.Equal(tb, source, r.Imported, "the record of %s names its import", ip)
		if withPod {
			require.Equal(tb, p.Metadata.Namespace+"/"+p.Metadata.Name, r.Namespace+"/"+r.Pod, "the record of %s names the pod", ip)
		}
	}
}

// recordsOwnedBy is kvipam's records whose container ID is one of ids.
func (c *kcluster) recordsOwnedBy(tb testing.TB, ids map[string]bool) []ipRecord {
	tb.Helper()
	recs, err := c.ipRecords()
	require.NoError(tb, err)
	var out []ipRecord
	for _, r := range recs {
		if ids[r.ContainerID] {
			out = append(out, r)
		}
	}
	return out
}

// restarts is the pod's containers' restart count and whether it is the
// same pod (UID) and Ready.
func (c *kcluster) requireUnrestarted(tb testing.TB, p pod) {
	tb.Helper()
	now, err := c.getPod(p.Metadata.Namespace, p.Metadata.Name)
	require.NoError(tb, err)
	require.Equal(tb, p.Metadata.UID, now.Metadata.UID, "%s: the same pod", p.Metadata.Name)
	require.True(tb, now.ready(), "%s is Ready", p.Metadata.Name)
	require.Equal(tb, p.ips(), now.ips(), "%s kept its addresses", p.Metadata.Name)
	for _, s := range now.Status.ContainerStatuses {
		require.Zero(tb, s.RestartCount, "%s: container %s not restarted", p.Metadata.Name, s.Name)
	}
}

// pingPair is a pinger from one old pod to another's address.
type pingPair struct {
	from, to string
	addr     netip.Addr
	netns    string // the pinging pod's network namespace
	p        *fastPinger
}

// rawDrops sums the drops column of the raw sockets of the network
// namespace at path (/proc/net/raw and raw6): replies that reached the
// pod but overflowed a pinger's receive buffer while the test process
// was not scheduled, which the pinger counts as lost although the
// network delivered them.
func rawDrops(path string) (int, error) {
	n := 0
	err := inNetns(path, func() error {
		for _, f := range []string{"/proc/thread-self/net/raw", "/proc/thread-self/net/raw6"} {
			b, err := os.ReadFile(f)
			if err != nil {
				return err
			}
			for i, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
				fs := strings.Fields(l)
				if i == 0 || len(fs) == 0 {
					continue
				}
				d, err := strconv.Atoi(fs[len(fs)-1])
				if err != nil {
					return fmt.Errorf("%s: %q: %w", f, l, err)
				}
				n += d
			}
		}
		return nil
	})
	return n, err
}

// startPings starts a pinger from each old pod on n1 to each address of
// the old pod on n2 of the same index, and back, and waits until each is
// answered.
func (c *kcluster) startPings(tb testing.TB, on1, on2 []pod) []*pingPair {
	tb.Helper()
	var pairs []*pingPair
	for i := range on1 {
		for _, ft := range [][2]pod{{on1[i], on2[i]}, {on2[i], on1[i]}} {
			ns, err := c.podNetns(ft[0])
			require.NoError(tb, err)
			for _, ip := range ft[1].ips() {
				a := netip.MustParseAddr(ip)
				p, err := startFastPinger(ns, a, adoptEvery)
				require.NoError(tb, err)
				tb.Cleanup(func() { p.Close(0) })
				pairs = append(pairs, &pingPair{from: ft[0].Metadata.Name, to: ft[1].Metadata.Name, addr: a, netns: ns, p: p})
			}
		}
	}
	t0 := time.Now()
	for _, pp := range pairs {
		require.NoError(tb, waitFor(2*time.Minute, fmt.Sprintf("%s's pings of %s (%s) answered", pp.from, pp.to, pp.addr), func() error {
			if _, ok := pp.p.firstReplySince(t0); !ok {
				return fmt.Errorf("no reply yet")
			}
			return nil
		}))
	}
	return pairs
}

// importLine is one line of kvipamctl import status -o json.
type importLine struct {
	Source    string `json:"source"`
	Node      string `json:"node"`
	Pool      string `json:"pool"`
	Imported  int    `json:"imported"`
	Held      int    `json:"held"`
	Borrowed  int    `json:"borrowed"`
	Finalized bool   `json:"finalized"`
}

// importStatus is kvipamctl import status's lines of source.
func (c *kcluster) importStatus(tb testing.TB, source string) []importLine {
	tb.Helper()
	out, err := c.kvipamctl("-o", "json", "import", "status")
	require.NoError(tb, err)
	var st struct {
		Imports []importLine `json:"imports"`
	}
	require.NoError(tb, json.Unmarshal([]byte(out), &st), "%s", out)
	var lines []importLine
	for _, l := range st.Imports {
		if l.Source == source {
			lines = append(lines, l)
		}
	}
	return lines
}

// runOldPod runs pod ns/name on node on the old network: the first pod
// of a node whose address is not in the node's old range was served by
// the network the node had before (kvipam's, installed by an earlier
// test) while containerd had not read the old network's conflist yet:
// it is deleted and made again.
func (c *kcluster) runOldPod(tb testing.TB, o *oldNet, ns, name, node string) pod {
	tb.Helper()
	var p pod
	require.NoError(tb, waitFor(3*time.Minute, node+" runs pods on the old network", func() error {
		p = c.runPod(tb, ns, name, node, nil)
		for _, ip := range p.ips() {
			in := false
			for _, r := range o.ranges[node] {
				in = in || netip.MustParsePrefix(r).Contains(netip.MustParseAddr(ip))
			}
			if !in {
				c.deletePod(tb, ns, name)
				return fmt.Errorf("%s got %v, not in %v", name, p.ips(), o.ranges[node])
			}
		}
		return nil
	}))
	return p
}
