package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"path/filepath"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/e2e/cluster"
	"github.com/kvipam/kvipam/internal/testsupport/releasetest"
)

// previousRelease is the release a snapshot crosses to or from.
const previousRelease = "v0.1.0"

// TestSnapshotAcrossVersions: an etcd snapshot taken while one version's
// agents run is restored into a fresh cluster, and the other version's
// agents start on the same nodes (their state directories kept, as an
// upgrade or a rollback done during a restore would): old-to-new takes
// v0.1.0's snapshot to HEAD, new-to-old HEAD's to v0.1.0, as
// docs/operations.md's "Restoring a snapshot across versions" says to.
// Two nodes hold dual-stack pods added through the CNI plugin, a sticky
// pod running and a sticky identity whose pod is gone (its address kept
// for it). After the restore every pod keeps its addresses and its owner
// record, the restored agents serve every pod (CNI CHECK passes),
// kvipamctl check of the restoring version is clean, new pods get
// addresses no one holds, the kept identity's next pod on the other node
// gets its address back, and a DEL of an old pod frees exactly its
// addresses.
func TestSnapshotAcrossVersions(t *testing.T) {
	requireRoot(t)
	head := release{name: "HEAD", bin: bins(t)}
	old := release{name: previousRelease, bin: releasetest.Build(t, previousRelease)}
	t.Run("old-to-new", func(t *testing.T) { snapshotAcross(t, old, head) })
	t.Run("new-to-old", func(t *testing.T) { snapshotAcross(t, head, old) })
}

// release is one version's binaries: the agent, the plugins and kvipamctl.
type release struct {
	name string // a version of RELEASES, or HEAD
	bin  string
}

// snapshotAcross writes with from's binaries, snapshots, restores into a
// fresh cluster and reads with to's.
func snapshotAcross(t *testing.T, from, to release) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	before := cluster.Start(t, cluster.Options{})
	const annotations = `,"capabilities":{"io.kubernetes.cri.pod-annotations":true}`
	a, b := newNode(t, "sa"), newNode(t, "sb")
	lists := map[*node]*libcni.NetworkConfigList{}
	for _, n := range []*node{a, b} {
		n.useBinaries(from.bin)
		n.startAgent(snapshotAgentOpts(before))
		lists[n] = n.kvipamList("kv", "1.0.0", annotations)
	}

	// Pods on both nodes, node a's filling more than one block of each
	// family; a sticky pod running; a sticky identity whose pod is gone.
	var pods []*pod
	podsOf := map[*pod]*node{}
	add := func(n *node, p *pod) {
		v4, v6 := podAddrs(t, n.mustAdd(lists[n], p))
		require.True(t, v4.IsValid() && v6.IsValid(), "dual-stack: %s got %s and %s", p.name, v4, v6)
		pods, podsOf[p] = append(pods, p), n
	}
	for i := range 10 {
		add(a, newPod(t, fmt.Sprintf("sa-%d", i)))
	}
	for i := range 3 {
		add(b, newPod(t, fmt.Sprintf("sb-%d", i)))
	}
	add(a, stickyPodOf(t, "web-0", 1, "10m"))
	gone := stickyPodOf(t, "web-1", 1, "10m")
	keptV4, keptV6 := podAddrs(t, a.mustAdd(lists[a], gone))
	require.NoError(t, a.del(lists[a], gone))

	cli := before.Client(t, cluster.RootUser)
	requireAgentsOf(t, cli, from, a, b)
	held := allocationsIn(t, cli)
	require.Len(t, held, 2*len(pods)+2, "every pod's two addresses and the kept identity's")
	require.Equal(t, "e2e/web-1", held[keptV4].Identity, "web-1's address is kept for it")
	served := map[*node][]string{a: endpointIPs(t, a), b: endpointIPs(t, b)}
	ctlFrom := a.clusterCtl(before)
	out, err := ctlFrom("check")
	require.NoError(t, err, "kvipamctl check before the snapshot:\n%s", out)

	snap := filepath.Join(t.TempDir(), "etcd.db")
	rev, err := before.Snapshot(ctx, 0, snap)
	require.NoError(t, err)
	t.Logf("snapshot of %d allocations at revision %d, written by %s's agents", len(held), rev, from.name)
	for _, n := range []*node{a, b} {
		n.stopAgent()
	}
	for i := range before.Len() {
		require.NoError(t, before.Kill(i))
	}

	after := cluster.Start(t, cluster.Options{})
	require.NoError(t, after.RestoreFrom(ctx, snap, 1_000_000))
	for _, n := range []*node{a, b} {
		n.useBinaries(to.bin)
		n.startAgent(snapshotAgentOpts(after))
		lists[n] = n.kvipamList("kv", "1.0.0", annotations)
	}
	cli = after.Client(t, cluster.RootUser)
	requireAgentsOf(t, cli, to, a, b)
	require.Equal(t, held, allocationsIn(t, cli), "every address with its owner record, as the snapshot held it")
	for n, eps := range served {
		require.Equal(t, eps, endpointIPs(t, n), "%s's agent serves the same pods with the same addresses", n.name)
	}
	for _, p := range pods {
		require.NoError(t, podsOf[p].check(lists[podsOf[p]], p), "CNI CHECK of %s under the restoring version", p.name)
	}
	ctl := a.clusterCtl(after)
	waitFor(t, 30*time.Second, "kvipamctl check of the restoring version to be clean", func() bool {
		out, err = ctl("check")
		return err == nil
	})
	t.Logf("kvipamctl check after the restore:\n%s", out)

	// New pods get addresses no one held and no other new pod got.
	taken := map[netip.Addr]string{}
	for addr, r := range held {
		taken[addr] = r.ContainerID
	}
	for i := range 4 {
		n := []*node{a, b}[i%2]
		p := newPod(t, fmt.Sprintf("new-%d", i))
		v4, v6 := podAddrs(t, n.mustAdd(lists[n], p))
		for _, addr := range []netip.Addr{v4, v6} {
			require.NotContains(t, taken, addr, "%s got %s, held by %s", p.name, addr, taken[addr])
			taken[addr] = p.rt.ContainerID
		}
	}
	// The kept identity's next pod, on the other node, gets its addresses.
	back := stickyPodOf(t, "web-1", 2, "10m")
	v4, v6 := podAddrs(t, b.mustAdd(lists[b], back))
	require.Equal(t, []netip.Addr{keptV4, keptV6}, []netip.Addr{v4, v6}, "web-1's next pod gets its kept addresses")

	// A DEL of an old pod frees its two addresses and nothing else.
	victim := pods[0]
	inEtcd := allocationsIn(t, cli)
	require.NoError(t, a.del(lists[a], victim))
	freed := allocationsIn(t, cli)
	var lost []netip.Addr
	for addr, r := range inEtcd {
		if _, ok := freed[addr]; !ok {
			lost = append(lost, addr)
			require.Equal(t, victim.rt.ContainerID, r.ContainerID, "the DEL of %s freed %s of %s", victim.name, addr, r.ContainerID)
		}
	}
	require.Len(t, lost, 2, "the DEL of %s freed its two addresses", victim.name)
	require.Len(t, freed, len(inEtcd)-2, "and nothing else changed hands")
	out, err = ctl("check")
	require.NoError(t, err, "kvipamctl check at the end:\n%s", out)
}

// snapshotAgentOpts are the agents' flags in TestSnapshotAcrossVersions:
// a dual-stack pool of /29s and /120s on etcd cluster c, no routing
// between the nodes (the test asks about records, not traffic).
func snapshotAgentOpts(c *cluster.Cluster) agentOpts {
	return agentOpts{pools: []string{"default=10.9.0.0/24,fd00:9::/112"}, blockV4: 29, etcd: c,
		gcInterval: time.Second, extra: []string{"--routing", "none"}}
}

// requireAgentsOf checks that the nodes' records name r's version: the
// agents that wrote them are r's (HEAD's is anything but a release's).
func requireAgentsOf(t *testing.T, cli *clientv3.Client, r release, nodes ...*node) {
	t.Helper()
	for _, n := range nodes {
		resp, err := cli.Get(context.Background(), etcdstore.NodeKey(n.name))
		require.NoError(t, err)
		require.Len(t, resp.Kvs, 1, "node record of %s", n.name)
		var rec etcdstore.NodeRecord
		require.NoError(t, json.Unmarshal(resp.Kvs[0].Value, &rec))
		if r.name == "HEAD" {
			require.NotEqual(t, previousRelease, rec.Version, "%s's agent is HEAD's", n.name)
		} else {
			require.Equal(t, r.name, rec.Version, "%s's agent is %s's", n.name, r.name)
		}
	}
}

// useBinaries makes the node run the agent, plugins and kvipamctl in dir
// from now on (another version's): its state directory, DEL queue and
// CNI cache stay, as a package upgrade leaves them.
func (n *node) useBinaries(dir string) {
	n.bin = dir
	n.cni = libcni.NewCNIConfigWithCacheDir([]string{dir}, filepath.Join(n.dir, "cni-cache"), nil)
}

// allocationsIn is every allocation of the pool default in etcd, by
// address: its owner, node, state, sticky identity and since.
func allocationsIn(t *testing.T, cli *clientv3.Client) map[netip.Addr]records.Record {
	t.Helper()
	resp, err := cli.Get(context.Background(), etcdstore.IPsPrefix("default"), clientv3.WithPrefix())
	require.NoError(t, err)
	out := map[netip.Addr]records.Record{}
	for _, kv := range resp.Kvs {
		al, err := etcdstore.DecodeAllocation("default", kv)
		require.NoError(t, err, "allocation %s", kv.Key)
		out[al.Addr] = al.Record
	}
	return out
}
