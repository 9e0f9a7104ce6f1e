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

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/allocator/schema"
	"github.com/kvipam/kvipam/e2e/cluster"
	"github.com/kvipam/kvipam/internal/testsupport/releasetest"
)

// previousRelease is the release the cross-version tests run beside
// HEAD: a snapshot crosses to or from it, and TestMixedVersionChaos's
// nodes run it or HEAD. Its schema level (1) is below HEAD's.
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
// addresses. The schema level: under HEAD, v0.1.0's data (level 1) is
// raised to 2 by the agents; before HEAD's snapshot for v0.1.0 the
// operator's rollback steps lower it to 1 (levelRaised,
// lowerForRollback); and a snapshot taken at level 2 shows what v0.1.0,
// which predates levels, does on it (olderAgentAboveItsLevel).
func TestSnapshotAcrossVersions(t *testing.T) {
	requireRoot(t)
	head := release{name: "HEAD", bin: bins(t)}
	old := release{name: previousRelease, bin: releasetest.Build(t, previousRelease)}
	t.Run("old-to-new", func(t *testing.T) {
		snapshotAcross(t, crossing{from: old, to: head, restored: levelRaised})
	})
	t.Run("new-to-old", func(t *testing.T) {
		var aboveOld string
		snapshotAcross(t, crossing{from: head, to: old, beforeSnapshot: func(t *testing.T, c *cluster.Cluster, ctl ctlFunc) {
			aboveOld = lowerForRollback(t, c, ctl)
		}})
		olderAgentAboveItsLevel(t, old, head, aboveOld)
	})
}

// release is one version's binaries: the agent, the plugins and kvipamctl.
type release struct {
	name string // a version of RELEASES, or HEAD
	bin  string
}

// ctlFunc runs a kvipamctl against an etcd cluster (node.clusterCtl).
type ctlFunc = func(args ...string) ([]byte, error)

// ctl runs r's kvipamctl against c, whatever a node runs meanwhile.
func (r release) ctl(t *testing.T, c *cluster.Cluster) ctlFunc {
	return (&node{t: t, bin: r.bin}).clusterCtl(c)
}

// crossing is one way across versions: who writes the snapshot, who
// reads it, and the operator's steps of that way.
type crossing struct {
	from, to release
	// beforeSnapshot, if set, runs on the writing cluster c, with from's
	// kvipamctl, before the snapshot is taken.
	beforeSnapshot func(t *testing.T, c *cluster.Cluster, ctl ctlFunc)
	// restored, if set, runs once to's agents serve the restored data,
	// with to's kvipamctl, before any new pod.
	restored func(t *testing.T, ctl ctlFunc)
}

// snapshotAcross writes with x.from's binaries, snapshots, restores into
// a fresh cluster and reads with x.to's.
func snapshotAcross(t *testing.T, x crossing) {
	from, to := x.from, x.to
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
	ctlFrom := from.ctl(t, before)
	out, err := ctlFrom("check")
	require.NoError(t, err, "kvipamctl check before the snapshot:\n%s", out)

	if x.beforeSnapshot != nil {
		x.beforeSnapshot(t, before, ctlFrom)
	}
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
	ctl := to.ctl(t, after)
	waitFor(t, 30*time.Second, "kvipamctl check of the restoring version to be clean", func() bool {
		out, err = ctl("check")
		return err == nil
	})
	t.Logf("kvipamctl check after the restore:\n%s", out)
	if x.restored != nil {
		x.restored(t, ctl)
	}

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

// clusterSchema is what `kvipamctl version -o json` says of the cluster.
type clusterSchema struct {
	Level     int  `json:"level"`
	Downgrade bool `json:"downgrade"`
	Nodes     []struct {
		Name    string `json:"name"`
		Version string `json:"version"`
		Level   int    `json:"level"`
	} `json:"nodes"`
}

// schemaOf asks ctl (HEAD's kvipamctl) for the cluster's schema level.
func schemaOf(t *testing.T, ctl ctlFunc) clusterSchema {
	t.Helper()
	out, err := ctl("version", "-o", "json")
	require.NoError(t, err, "kvipamctl version:\n%s", out)
	var v struct {
		Cluster *clusterSchema `json:"cluster"`
	}
	require.NoError(t, json.Unmarshal(out, &v), "kvipamctl version -o json:\n%s", out)
	require.NotNil(t, v.Cluster, "kvipamctl version -o json names the cluster's level:\n%s", out)
	return *v.Cluster
}

// awaitLevel waits until the agents have raised the cluster's level to
// level (they do once every live node understands it).
func awaitLevel(t *testing.T, ctl ctlFunc, level int) {
	t.Helper()
	waitFor(t, 30*time.Second, fmt.Sprintf("the agents to raise the cluster's schema level to %d", level), func() bool {
		return schemaOf(t, ctl).Level == level
	})
}

// levelRaised (old-to-new, HEAD's kvipamctl): v0.1.0's data is level 1;
// once both restored nodes run HEAD's agents they raise it to HEAD's
// highest, and a level-2 write (a pool's max-blocks) is taken.
func levelRaised(t *testing.T, ctl ctlFunc) {
	awaitLevel(t, ctl, int(schema.Highest()))
	out, err := ctl("pool", "set-max-blocks", "default", "8")
	require.NoError(t, err, "pool set-max-blocks at level 2:\n%s", out)
	out, err = ctl("version")
	require.NoError(t, err)
	t.Logf("kvipamctl version after the restore under HEAD:\n%s", out)
}

// lowerForRollback (new-to-old, HEAD's kvipamctl on HEAD's cluster c) is
// the operator's rollback procedure before the snapshot: the agents have
// raised the level to HEAD's highest and a pool uses level 2 (max-blocks 1); a downgrade to
// v0.1.0 is refused while it does; the max-blocks cleared, it is
// validated and enabled, and the level is held at 1. It returns a
// snapshot of c taken before the procedure, at level 2.
func lowerForRollback(t *testing.T, c *cluster.Cluster, ctl ctlFunc) (aboveOld string) {
	t.Helper()
	awaitLevel(t, ctl, int(schema.Highest()))
	out, err := ctl("pool", "set-max-blocks", "default", "1")
	require.NoError(t, err, "pool set-max-blocks at level 2:\n%s", out)
	aboveOld = filepath.Join(t.TempDir(), "level2.db")
	_, err = c.Snapshot(context.Background(), 0, aboveOld)
	require.NoError(t, err)

	out, err = ctl("downgrade", "enable", previousRelease)
	require.Error(t, err, "a downgrade while a pool sets max-blocks:\n%s", out)
	t.Logf("kvipamctl downgrade enable %s while a pool sets max-blocks: %s", previousRelease, out)
	require.Equal(t, int(schema.Highest()), schemaOf(t, ctl).Level, "the refused downgrade changed nothing")
	for _, args := range [][]string{
		{"pool", "set-max-blocks", "default", "none"},
		{"downgrade", "validate", previousRelease},
		{"downgrade", "enable", previousRelease},
	} {
		out, err := ctl(args...)
		require.NoError(t, err, "kvipamctl %v:\n%s", args, out)
	}
	got := schemaOf(t, ctl)
	require.Equal(t, 1, got.Level, "the level is v0.1.0's")
	require.True(t, got.Downgrade, "and held there")
	return aboveOld
}

// olderAgentAboveItsLevel restores the snapshot aboveOld, taken at level
// 2 with a pool whose max-blocks is 1, into a fresh cluster and starts
// old's agent on a new node. v0.1.0 predates the schema level, so it
// cannot refuse: it starts, serves, and claims a second block of the pool
// where a level-2 agent would borrow; HEAD's kvipamctl check reports the
// node as below the cluster's level until the level is lowered. This is what the rollback
// procedure's lowering before the snapshot prevents (docs/operations.md,
// "Restoring a snapshot across versions"); an agent that knows levels
// refuses (TestNewerSchemaRefusedAtStart).
func olderAgentAboveItsLevel(t *testing.T, old, head release, aboveOld string) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c := cluster.Start(t, cluster.Options{})
	require.NoError(t, c.RestoreFrom(ctx, aboveOld, 1_000_000))
	headCtl := head.ctl(t, c)
	require.Equal(t, int(schema.Highest()), schemaOf(t, headCtl).Level, "the snapshot holds HEAD's level")
	n := newNode(t, "sc")
	n.useBinaries(old.bin)
	n.startAgent(snapshotAgentOpts(c)) // ready: v0.1.0 does not refuse
	cl := n.client()
	for i := 0; len(n.poolStatus("default", "ipv4").Blocks) < 2; i++ {
		require.Less(t, i, 64, "v0.1.0's agent keeps to one block")
		_, err := cl.Allocate(ctx, api.AllocateRequest{Owner: api.Owner{ContainerID: fmt.Sprintf("above-%02d", i), IfName: "eth0"}, Pool: "default", Permanent: true})
		require.NoError(t, err)
	}
	got := schemaOf(t, headCtl)
	t.Logf("%s's agent started on a level-%d snapshot (cluster %+v) and claimed blocks %v in a pool of max-blocks 1",
		old.name, got.Level, got, n.poolStatus("default", "ipv4").Blocks)
	// HEAD's kvipamctl check names the node that runs below the level.
	out, err := headCtl("check")
	require.Error(t, err, "HEAD's kvipamctl check of a v0.1.0 agent at level 2:\n%s", out)
	require.Contains(t, string(out), "below-schema")
	require.Contains(t, string(out), "node sc runs "+old.name)
	t.Logf("HEAD's kvipamctl check:\n%s", out)

	// The remedy on restored data, before (or, as here, after) an older
	// agent starts: the rollback's steps with HEAD's kvipamctl.
	for _, args := range [][]string{
		{"pool", "set-max-blocks", "default", "none"},
		{"downgrade", "enable", previousRelease},
	} {
		out, err := headCtl(args...)
		require.NoError(t, err, "kvipamctl %v on the restored data:\n%s", args, out)
	}
	out, _ = headCtl("check") // the restored nodes' leases may end meanwhile: their blocks are then orphaned
	require.NotContains(t, string(out), "below-schema", "the level is v0.1.0's:\n%s", out)
}
