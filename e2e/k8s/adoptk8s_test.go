package k8s

import (
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// hostLocalNet is the old network of TestK8sAdoptFromHostLocal: a range
// of each family per node, as a node's podCIDR gives host-local.
func hostLocalNet() *oldNet {
	o := &oldNet{pool: "adopt-hl", cidrs: []string{"10.247.0.0/16", "fd00:247::/64"},
		ranges: map[string][]string{"n1": {"10.247.1.0/24", "fd00:247::1:0/112"}, "n2": {"10.247.2.0/24", "fd00:247::2:0/112"}},
		gws:    map[string][]string{"n1": {"10.247.1.1", "fd00:247::1:1"}, "n2": {"10.247.2.1", "fd00:247::2:1"}}}
	o.ipam = func(node string) map[string]any {
		var ranges []any
		for _, r := range o.ranges[node] {
			ranges = append(ranges, []any{map[string]string{"subnet": r}})
		}
		return map[string]any{"type": "host-local", "ranges": ranges}
	}
	return o
}

// adoption is one run of an adoption test: the old network's pods and
// pings, the import (by importFn: dry run first, then for real), the
// switch, new pods, the old pods deleted.
type adoption struct {
	ns      string
	net     *oldNet
	plugins []string // the old IPAM's plugin binaries
	// importFn runs kvipamctl import for the cluster's old pods, a dry
	// run when dry, printing JSON when asJSON; it returns the output.
	importFn func(tb testing.TB, dry, asJSON bool) string
	// source is the import source (kvipamctl import status's) of the old
	// pods of node.
	source func(node string) string
	// finalize runs kvipamctl import finalize of every source.
	finalize func(tb testing.TB)
	withPod  bool // the source knows each address's pod
	// toKvipam: after the switch to kvipam-ipam, the network too: kvipam's
	// own conflist (its datapath), with the old pods still on the bridge.
	toKvipam bool
}

// TestK8sAdoptFromHostLocal: two kubelets whose pods run on bridge with
// the real host-local (a range per node), pings between old pods across
// the nodes every 20 ms in both families; kvipam's agents installed in an
// adoption's order (no conflist), kvipamctl import host-local on each node
// (a dry run first), the conflist switched to kvipam-ipam under bridge,
// new pods on both nodes that reach the old ones on their own node and
// the other; then the network switched to kvipam's own (the DaemonSet's
// manifest applied as it is, which restarts the agents and installs
// 10-kvipam.conflist, and the old conflist removed), whose new pods
// reach the old ones, still on the bridge, on both nodes; the old pods
// deleted. No old pod restarted, no ping lost,
// every old address a kvipam record owned by its pod's sandbox, check
// clean, and no imported record left once the old pods are gone.
func TestK8sAdoptFromHostLocal(t *testing.T) {
	c := cluster(t)
	a := &adoption{ns: "k8s-adopt-hl", net: hostLocalNet(), plugins: []string{"host-local"}, toKvipam: true}
	a.importFn = func(tb testing.TB, dry, asJSON bool) string {
		var all []string
		for _, n := range c.nodes {
			args := []string{"import", "host-local", "--node", n.name, "--pool", a.net.pool, "--dir", "/var/lib/cni/networks/" + adoptNet}
			if dry {
				args = append(args, "--dry-run")
			}
			if asJSON {
				args = append([]string{"-o", "json"}, args...)
			}
			out, err := c.kvipamctlOn(n, args...)
			require.NoError(tb, err, "kvipamctl %s on %s: %s", strings.Join(args, " "), n.name, out)
			all = append(all, fmt.Sprintf("%s: kvipamctl %s:\n%s", n.name, strings.Join(args, " "), strings.TrimSpace(out)))
		}
		return strings.Join(all, "\n")
	}
	a.source = func(node string) string { return "host-local:" + node + ":" + adoptNet }
	a.finalize = func(tb testing.TB) {
		for _, n := range c.nodes {
			out, err := c.kvipamctlOn(n, "import", "finalize", a.source(n.name), "--dir", "/var/lib/cni/networks/"+adoptNet)
			require.NoError(tb, err, "finalize on %s: %s", n.name, out)
			tb.Logf("%s: kvipamctl import finalize %s --dir ...:\n%s", n.name, a.source(n.name), strings.TrimSpace(out))
			files, err := c.inNodeRun(n, "ls", "/var/lib/cni/networks/"+adoptNet)
			require.NoError(tb, err)
			tb.Logf("%s: host-local's files after finalize: %s", n.name, strings.Join(strings.Fields(files), " "))
		}
	}
	c.runAdoption(t, a)
}

func (c *kcluster) runAdoption(t *testing.T, a *adoption) {
	c.startOldNet(t, a.net, a.plugins...)
	t.Cleanup(func() { c.deleteNamespace(t, a.ns) })
	start := time.Now()

	// The old pods, two on each node, and their attachments.
	on1 := []pod{c.runOldPod(t, a.net, a.ns, "old-a1", "n1"), c.runOldPod(t, a.net, a.ns, "old-a2", "n1")}
	on2 := []pod{c.runOldPod(t, a.net, a.ns, "old-b1", "n2"), c.runOldPod(t, a.net, a.ns, "old-b2", "n2")}
	old := append(append([]pod{}, on1...), on2...)
	atts := map[string]cniAttachment{}
	ids := map[string]bool{}
	oldIPs := map[string]bool{}
	for _, p := range old {
		for _, ip := range p.ips() {
			in := false
			for _, r := range a.net.ranges[p.Spec.NodeName] {
				in = in || netip.MustParsePrefix(r).Contains(netip.MustParseAddr(ip))
			}
			require.True(t, in, "old pod %s's address %s is in its node's old range %v", p.Metadata.Name, ip, a.net.ranges[p.Spec.NodeName])
			oldIPs[ip] = true
		}
		atts[p.Metadata.Name] = c.attachmentOf(t, p)
		ids[atts[p.Metadata.Name].ContainerID] = true
		t.Logf("old pod %s on %s: %v, sandbox %s", p.Metadata.Name, p.Spec.NodeName, p.ips(), atts[p.Metadata.Name].ContainerID)
	}
	pings := c.startPings(t, on1, on2)
	pingsFrom := time.Now()

	// kvipam's agents, the pool, the import: a dry run writes nothing.
	c.installForAdoption(t)
	c.ensurePool(t, a.net)
	importStart := time.Now()
	t.Logf("the dry run's plan:\n%s", a.importFn(t, true, false))
	plan := a.importFn(t, true, true)
	for _, p := range old {
		for _, ip := range p.ips() {
			require.Contains(t, plan, fmt.Sprintf(`"ip": %q`, ip), "the plan (-o json) names %s", ip)
		}
		require.Contains(t, plan, atts[p.Metadata.Name].ContainerID, "the plan names %s's sandbox", p.Metadata.Name)
	}
	require.Empty(t, c.recordsOwnedBy(t, ids), "a dry run writes nothing")
	out := a.importFn(t, false, false)
	importTook := time.Since(importStart)
	t.Logf("the import:\n%s", out)
	for _, p := range old {
		c.requireImported(t, a.net.pool, a.source(p.Spec.NodeName), p, atts[p.Metadata.Name], a.withPod)
	}
	sources := map[string]int{} // the old addresses of each source
	for _, p := range old {
		sources[a.source(p.Spec.NodeName)] += len(p.ips())
	}
	for src, want := range sources {
		imported, held := 0, 0
		for _, l := range c.importStatus(t, src) {
			imported, held = imported+l.Imported, held+l.Held
		}
		require.Equal(t, want, imported, "import status: %s imported every old address", src)
		require.Equal(t, want, held, "import status: kvipam holds every address %s imported", src)
	}
	status, err := c.kvipamctl("import", "status")
	require.NoError(t, err)
	t.Logf("kvipamctl import status:\n%s", strings.TrimSpace(status))
	out, err = c.kvipamctl("check")
	require.NoError(t, err, "kvipamctl check after the import: %s", out)

	// The switch, then new pods: kvipam's (the first pod of a node whose
	// address has no kvipam record was served before containerd read the
	// new conflist: it is deleted and made again).
	switchAt := time.Now()
	for _, n := range c.nodes {
		c.switchNode(t, a.net, n)
	}
	var fresh []pod
	for _, node := range []string{"n1", "n2"} {
		name := "new-" + node
		var p pod
		require.NoError(t, waitFor(3*time.Minute, node+" serves new pods from kvipam", func() error {
			p = c.runPod(t, a.ns, name, node, nil)
			if len(c.recordsOf(t, a.ns, name)) > 0 {
				return nil
			}
			c.deletePod(t, a.ns, name)
			return fmt.Errorf("%s got %v from the old IPAM", name, p.ips())
		}))
		for _, ip := range p.ips() {
			require.False(t, oldIPs[ip], "new pod %s's address %s is not an old pod's", name, ip)
			in := false
			for _, cidr := range a.net.cidrs {
				in = in || netip.MustParsePrefix(cidr).Contains(netip.MustParseAddr(ip))
			}
			require.True(t, in, "new pod %s's address %s is in pool %s", name, ip, a.net.pool)
		}
		c.requireRecords(t, p)
		t.Logf("new pod %s on %s: %v", name, node, p.ips())
		fresh = append(fresh, p)
	}
	// New pods reach the old ones on their own node and on the other, and
	// back.
	for _, nw := range fresh {
		for _, o := range []pod{on1[0], on2[0]} {
			for _, ip := range o.ips() {
				c.pingEventually(t, a.ns, nw.Metadata.Name, ip)
			}
			for _, ip := range nw.ips() {
				c.pingEventually(t, a.ns, o.Metadata.Name, ip)
			}
		}
	}
	switchTook := time.Since(switchAt)
	var netTook time.Duration
	if a.toKvipam {
		netAt := time.Now()
		fresh = append(fresh, c.switchNetwork(t, a, on1[0], on2[0])...)
		netTook = time.Since(netAt)
	}

	// The old pods: never restarted, no ping lost.
	for _, p := range old {
		c.requireUnrestarted(t, p)
	}
	pingsTo := time.Now()
	drops := map[string]int{} // by pinging namespace
	for _, pp := range pings {
		if _, ok := drops[pp.netns]; !ok {
			d, err := rawDrops(pp.netns)
			require.NoError(t, err)
			drops[pp.netns] = d
		}
	}
	for _, pp := range pings {
		pp.p.Close(time.Second)
	}
	sent, lost, dropped := 0, 0, 0
	lostIn := map[string]int{}
	for _, pp := range pings {
		f := pp.p.figures(pingsFrom, pingsTo)
		sent, lost = sent+f.Sent, lost+f.Lost
		lostIn[pp.netns] += f.Lost
		t.Logf("%s -> %s %s: %d pings every %s, %d lost, %d unreachable, %d sends failed %v",
			pp.from, pp.to, pp.addr, f.Sent, adoptEvery, f.Lost, f.Unreachable, pp.p.sendErrors(), pp.p.icmpErrors())
	}
	for ns, d := range drops {
		dropped += d
		if lostIn[ns] > 0 || d > 0 {
			t.Logf("%s: %d pings counted lost by its pingers, %d replies dropped by their sockets' full receive buffers (the test process not scheduled)", ns, lostIn[ns], d)
		}
	}
	for _, pp := range pings {
		require.Zero(t, pp.p.sendErrors(), "%s -> %s %s: no send failed", pp.from, pp.to, pp.addr)
	}
	for ns, l := range lostIn {
		// A reply the pod's socket dropped was delivered by the network.
		require.LessOrEqual(t, l, drops[ns], "%s: no ping lost in the network (lost %d, dropped by the pingers' own sockets %d)", ns, l, drops[ns])
	}

	// The old pods deleted: their DELs, now kvipam-ipam's, free exactly
	// their imported addresses.
	delAt := time.Now()
	for _, p := range old {
		c.deletePod(t, a.ns, p.Metadata.Name)
	}
	require.NoError(t, waitFor(3*time.Minute, "no imported record left", func() error {
		if recs := c.recordsOwnedBy(t, ids); len(recs) > 0 {
			return fmt.Errorf("records of old pods: %+v", recs)
		}
		return nil
	}))
	delTook := time.Since(delAt)
	for _, p := range fresh {
		c.requireRecords(t, p)
	}
	status, err = c.kvipamctl("import", "status")
	require.NoError(t, err)
	t.Logf("kvipamctl import status after the old pods' deletion:\n%s", strings.TrimSpace(status))
	for src := range sources {
		for _, l := range c.importStatus(t, src) {
			require.Zero(t, l.Held, "import status: no address of %s held on %s after the old pods' deletion", src, l.Node)
		}
	}
	a.finalize(t)
	for src := range sources {
		for _, l := range c.importStatus(t, src) {
			require.True(t, l.Finalized, "import status: %s finalized: %+v", src, l)
		}
	}
	out, err = c.kvipamctl("check")
	require.NoError(t, err, "kvipamctl check after the old pods' deletion: %s", out)

	netSwitch := ""
	if a.toKvipam {
		netSwitch = fmt.Sprintf(", the network switched to kvipam to its new pods reaching the old %s", netTook.Round(time.Millisecond))
	}
	t.Logf("figures: %d old pods (0 restarts), %d new pods; %d pings sent between the old pods across the nodes over %s, %d lost (%d replies dropped by the pingers' sockets); import (dry run and real) %s, switch to the new pods reaching the old %s%s, the old pods' deletion to no imported record %s; the whole test %s",
		len(old), len(fresh), sent, pingsTo.Sub(pingsFrom).Round(time.Millisecond), lost, dropped, importTook.Round(time.Millisecond),
		switchTook.Round(time.Millisecond), netSwitch, delTook.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
}

// switchNetwork is the network's switch to kvipam (docs/kubernetes.md,
// "Adopting a running cluster", step 7) with old pods a1 (n1) and b1 (n2)
// still on the bridge: kvipam's manifest applied as it is (the agents
// restart; the init container installs 10-kvipam.conflist), the switched
// conflist removed, then a new pod on each node on kvipam's datapath,
// which reaches the old pods on its node and the other, and they it. The
// new pods are in the default pool, not the adoption's: an old pod holds
// its old subnet on-link (host-local's /24), so it would look for a new
// pod of that subnet on the bridge (ARP, neighbour discovery), where
// kvipam's veth is not. It returns the new pods.
func (c *kcluster) switchNetwork(t *testing.T, a *adoption, a1, b1 pod) []pod {
	c.install(t)
	for _, n := range c.nodes {
		_, err := c.inNodeRun(n, "rm", "-f", "/etc/cni/net.d/"+adoptConf)
		require.NoError(t, err)
	}
	var fresh []pod
	for _, node := range []string{"n1", "n2"} {
		name := "kv-" + node
		var p pod
		require.NoError(t, waitFor(3*time.Minute, node+" serves new pods on kvipam's network", func() error {
			p = c.runPod(t, a.ns, name, node, nil)
			recs := c.recordsOf(t, a.ns, name)
			if len(recs) > 0 && recs[0].Network == "kvipam" {
				return nil
			}
			c.deletePod(t, a.ns, name)
			return fmt.Errorf("%s got %v on network %+v", name, p.ips(), recs)
		}))
		requireIPsIn(t, p, "default")
		c.requireRecords(t, p)
		t.Logf("new pod %s on %s, kvipam's network: %v", name, node, p.ips())
		for _, o := range []pod{a1, b1} {
			for _, ip := range o.ips() {
				c.pingEventually(t, a.ns, name, ip)
			}
			for _, ip := range p.ips() {
				c.pingEventually(t, a.ns, o.Metadata.Name, ip)
			}
		}
		fresh = append(fresh, p)
	}
	return fresh
}
