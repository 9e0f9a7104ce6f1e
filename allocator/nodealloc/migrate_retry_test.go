package nodealloc_test

import (
	"context"
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/allocator/schema"
	"github.com/kvipam/kvipam/internal/foundation/retry"
)

// migrationLive gives each node its node record, on its lease, and the
// cluster the schema level a live migration needs, as the agents do.
func migrationLive(t *testing.T, nodes ...*testNode) {
	t.Helper()
	ctx := context.Background()
	for _, n := range nodes {
		rec := etcdstore.NodeRecord{Name: n.name, StartedAt: time.Now().UTC(), Lease: int64(n.sess.ID()), Features: schema.Names()}
		require.NoError(t, n.store.WriteNode(ctx, rec, int64(n.sess.ID())))
	}
	_, _, err := nodes[0].store.RaiseSchema(ctx, schema.Highest(), nodes[0].name, "test")
	require.NoError(t, err)
}

// TestMigrationSourceAddRetried: the source pod's ADD retried (by its
// runtime) while its identity migrates rewrites the binding from its
// own addresses; the binding names the alternate still, as the records
// do, and the cut-over goes on. Found by the model test (seed 1 of
// TestModelSimulated): the retry wrote a binding without the alternate
// while every record named it.
func TestMigrationSourceAddRetried(t *testing.T) {
	ctx := context.Background()
	e := startEtcd(t, onePool)
	a := startNode(t, e, "a", []string{"one"}, nodeOpts{})
	b := startNode(t, e, "b", []string{"one"}, nodeOpts{})
	migrationLive(t, a, b)
	src := stickyPod("vm-0", 1)
	req := stickyReq(src, time.Minute)
	res, err := a.alloc.Allocate(ctx, req)
	require.NoError(t, err)
	x := res.Allocations[0].Addr
	dst := records.Owner{ContainerID: "target-1", IfName: "eth0", Namespace: "ns", Pod: "virt-launcher-vm-0-b"}
	treq := nodealloc.Request{Pool: "one", Owner: dst, Sticky: req.Sticky, Migration: "job-1"}
	adm, ok, err := b.alloc.Admit(ctx, treq)
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, x, adm.Allocations[0].Addr)

	again, err := a.alloc.Allocate(ctx, req)
	require.NoError(t, err)
	require.Equal(t, x, again.Allocations[0].Addr)
	bd, found, err := a.store.GetBinding(ctx, "one", "ns/vm-0")
	require.NoError(t, err)
	require.True(t, found)
	require.NotNil(t, bd.Alternate, "the source's retried ADD dropped the alternate from the binding: %+v", bd)
	require.Equal(t, dst.Key(), bd.Alternate.Owner.Key())
	for _, al := range storeIPs(t, a.cli, "one") {
		require.NotNil(t, al.Alternate, "%s", al.Addr)
		require.Equal(t, dst.Key(), al.Alternate.Owner.Key())
	}
	require.NoError(t, b.alloc.CutOver(ctx, "one", "ns/vm-0", dst))
	bd, _, err = a.store.GetBinding(ctx, "one", "ns/vm-0")
	require.NoError(t, err)
	require.Equal(t, dst.Key(), bd.Owner.Key())
	require.Equal(t, "b", bd.Node)
}

// dualPool serves both families, in blocks of 16 and 8 addresses.
var dualPool = allocator.Pool{Name: "dual", BlockSizeV4: 28, BlockSizeV6: 125,
	CIDRs: []netip.Prefix{netip.MustParsePrefix("10.83.0.0/27"), netip.MustParsePrefix("fd00:83::/123")}}

// migrated binds a VM's identity to src on a, with an address of each
// family, and admits dst on b as its alternate.
func migrated(t *testing.T, a, b *testNode, pool string) (src, dst records.Owner, req nodealloc.Request) {
	t.Helper()
	ctx := context.Background()
	src = stickyPod("vm-0", 1)
	req = stickyReq(src, time.Minute)
	req.Pool = pool
	_, err := a.alloc.Allocate(ctx, req)
	require.NoError(t, err)
	dst = records.Owner{ContainerID: "target-1", IfName: "eth0", Namespace: "ns", Pod: "virt-launcher-vm-0-b"}
	treq := nodealloc.Request{Pool: pool, Owner: dst, Sticky: req.Sticky, Migration: "job-1"}
	_, ok, err := b.alloc.Admit(ctx, treq)
	require.NoError(t, err)
	require.True(t, ok)
	return src, dst, req
}

// keptForIdentity requires every record of pool to be kept for identity, and its
// binding kept with no alternate: no pod holds them.
func keptForIdentity(t *testing.T, n *testNode, pool, identity string, want int) {
	t.Helper()
	als := storeIPs(t, n.cli, pool)
	require.Len(t, als, want)
	for _, al := range als {
		require.Equal(t, records.StateKept, al.State, "%s held by %s", al.Addr, al.Owner.Key())
		require.Equal(t, identity, al.Identity)
		require.Nil(t, al.Alternate)
	}
	bd, ok, err := n.store.GetBinding(context.Background(), pool, identity)
	require.NoError(t, err)
	require.True(t, ok)
	require.True(t, bd.Kept(), "%+v", bd)
	require.Nil(t, bd.Alternate)
}

// TestMigrationSourceDelTargetNodeGone: the source's DEL while the
// target's node has no live record (cut off from etcd past its lease,
// its pod, the VM's only one now, maybe running there) is refused, to be
// tried again, and writes nothing: dropping the alternate and keeping
// the addresses for the identity gave them to the VM's next pod while
// the target ran (the chaos run with migrations: a duplicate after
// etcd-cut-mid-migration). With the target's node back, the DEL tried
// again hands the addresses over to it.
func TestMigrationSourceDelTargetNodeGone(t *testing.T) {
	ctx := context.Background()
	e := startEtcd(t, dualPool)
	a := startNode(t, e, "a", []string{"dual"}, nodeOpts{})
	b := startNode(t, e, "b", []string{"dual"}, nodeOpts{})
	migrationLive(t, a, b)
	src, dst, _ := migrated(t, a, b, "dual")
	rec, err := a.cli.Get(ctx, etcdstore.NodeKey("b"))
	require.NoError(t, err)
	require.Len(t, rec.Kvs, 1)
	_, err = a.cli.Delete(ctx, etcdstore.NodeKey("b"))
	require.NoError(t, err)
	before, _, err := a.store.GetBinding(ctx, "dual", "ns/vm-0")
	require.NoError(t, err)

	_, err = a.alloc.ReleaseAs(ctx, src, "ns/vm-0")
	require.ErrorIs(t, err, retry.ErrUnavailable, "the source's DEL while the target's node is away")
	after, _, err := a.store.GetBinding(ctx, "dual", "ns/vm-0")
	require.NoError(t, err)
	require.Equal(t, before.Rev, after.Rev, "the refused DEL wrote nothing")
	require.NotNil(t, after.Alternate)
	for _, al := range storeIPs(t, a.cli, "dual") {
		require.Equal(t, src.Key(), al.Owner.Key(), "%s", al.Addr)
		require.NotNil(t, al.Alternate, "%s keeps its alternate", al.Addr)
	}

	_, err = a.cli.Put(ctx, etcdstore.NodeKey("b"), string(rec.Kvs[0].Value), clientv3.WithLease(clientv3.LeaseID(rec.Kvs[0].Lease)))
	require.NoError(t, err)
	_, err = a.alloc.ReleaseAs(ctx, src, "ns/vm-0")
	require.NoError(t, err, "the DEL tried again, the target's node back")
	bd, _, err := a.store.GetBinding(ctx, "dual", "ns/vm-0")
	require.NoError(t, err)
	require.Equal(t, dst.Key(), bd.Owner.Key(), "handed over to the target")
	require.Nil(t, bd.Alternate)
}

// TestMigrationTargetDelAfterUnlearnedHandOver: the source's DEL hands
// the addresses to the target, on the source's node; the target's DEL
// comes before its node learned them all (its watch of the bindings
// late), and keeps them all for the identity. Found by the model test
// (TestModelSimulated seeds 1 and 2): with none of them cached, the DEL
// found nothing to keep and answered success; with one cached, it kept
// that one; either way the rest stayed the deleted pod's.
func TestMigrationTargetDelAfterUnlearnedHandOver(t *testing.T) {
	for _, learned := range []int{0, 1} {
		t.Run(fmt.Sprintf("learned=%d", learned), func(t *testing.T) {
			ctx := context.Background()
			e := startEtcd(t, dualPool)
			a := startNode(t, e, "a", []string{"dual"}, nodeOpts{})
			b := startNode(t, e, "b", []string{"dual"}, nodeOpts{})
			migrationLive(t, a, b)
			src, dst, _ := migrated(t, a, b, "dual")
			_, err := a.alloc.ReleaseAs(ctx, src, "ns/vm-0")
			require.NoError(t, err)
			bd, _, err := a.store.GetBinding(ctx, "dual", "ns/vm-0")
			require.NoError(t, err)
			require.Equal(t, dst.Key(), bd.Owner.Key(), "handed to the target")
			refs, err := b.alloc.BoundRefs(bd)
			require.NoError(t, err)
			require.NoError(t, b.alloc.Learn(ctx, refs[:learned]))
			_, err = b.alloc.ReleaseAs(ctx, dst, "ns/vm-0")
			require.NoError(t, err)
			keptForIdentity(t, a, "dual", "ns/vm-0", 2)
		})
	}
}

// TestMigrationTargetOnUnselectedNodeRefused: a migration's target on a
// node the pool's selector leaves out is refused, as a takeover there
// is: its addresses would route to a node the pool does not serve.
// Found by the model test (TestModelSimulated seeds 8 and 9).
func TestMigrationTargetOnUnselectedNodeRefused(t *testing.T) {
	ctx := context.Background()
	p := onePool
	p.NodeSelector = "node!=b"
	e := startEtcd(t, p)
	a := startNode(t, e, "a", []string{"one"}, nodeOpts{labels: map[string]string{"node": "a"}})
	b := startNode(t, e, "b", []string{"one"}, nodeOpts{labels: map[string]string{"node": "b"}})
	migrationLive(t, a, b)
	src := stickyPod("vm-0", 1)
	req := stickyReq(src, time.Minute)
	_, err := a.alloc.Allocate(ctx, req)
	require.NoError(t, err)
	dst := records.Owner{ContainerID: "target-1", IfName: "eth0", Namespace: "ns", Pod: "virt-launcher-vm-0-b"}
	_, ok, err := b.alloc.Admit(ctx, nodealloc.Request{Pool: "one", Owner: dst, Sticky: req.Sticky, Migration: "job-1"})
	require.ErrorIs(t, err, records.ErrNodeNotSelected)
	require.False(t, ok)
	bd, _, err := a.store.GetBinding(ctx, "one", "ns/vm-0")
	require.NoError(t, err)
	require.Nil(t, bd.Alternate)
}

// TestMigrationReassertAfterAlternateLeft: a record etcd lost is written
// back naming the alternate its binding names, not the one the cache
// last saw. Found by the model test (TestModelSimulated seed 4747): the
// source's node had read its record while a target was its alternate;
// the target's DEL dropped it; the record, lost and written back from
// the cache, named the departed target while the binding named nobody.
func TestMigrationReassertAfterAlternateLeft(t *testing.T) {
	ctx := context.Background()
	e := startEtcd(t, onePool)
	a := startNode(t, e, "a", []string{"one"}, nodeOpts{})
	b := startNode(t, e, "b", []string{"one"}, nodeOpts{})
	migrationLive(t, a, b)
	src, dst, _ := migrated(t, a, b, "one")
	bd, _, err := a.store.GetBinding(ctx, "one", "ns/vm-0")
	require.NoError(t, err)
	refs, err := a.alloc.BoundRefs(bd)
	require.NoError(t, err)
	require.NoError(t, a.alloc.Learn(ctx, refs)) // a's cache: the record naming the alternate
	_, err = b.alloc.ReleaseAs(ctx, dst, "ns/vm-0")
	require.NoError(t, err)
	x := bd.Addrs[0]
	_, err = a.cli.Delete(ctx, etcdstore.IPKey("one", refs[0].Block, x)) // etcd restored from an older snapshot
	require.NoError(t, err)
	restored, conflicts, err := a.alloc.Reassert(ctx, []nodealloc.HeldAddr{{Owner: src, Addr: x, Identity: "ns/vm-0", WindowSeconds: 60}})
	require.NoError(t, err)
	require.Empty(t, conflicts)
	require.Len(t, restored, 1)
	als := storeIPs(t, a.cli, "one")
	require.Len(t, als, 1)
	require.Nil(t, als[0].Alternate, "written back naming the alternate that left")
}

// TestMigrationTargetAddRetriedAfterUnlearnedHandOver: the target, the
// owner since a hand-over its node has not learned, has its ADD retried
// (a plain sticky ADD: nothing to migrate from), and the binding's write
// fails before it is sent. The addresses, read back as the pod's, are
// not given back as if the failed request had borrowed them. Found by
// the model test (TestModelNodeAllocator seed 4704): the binding and the
// records went, with the pod running.
func TestMigrationTargetAddRetriedAfterUnlearnedHandOver(t *testing.T) {
	ctx := context.Background()
	e := startEtcd(t, dualPool)
	a := startNode(t, e, "a", []string{"dual"}, nodeOpts{})
	h := newHookStore(nil)
	b := startNode(t, e, "b", []string{"dual"}, nodeOpts{wrap: func(s records.Store) records.Store { h.Store = s; return h }})
	migrationLive(t, a, b)
	src, dst, req := migrated(t, a, b, "dual")
	_, err := a.alloc.ReleaseAs(ctx, src, "ns/vm-0")
	require.NoError(t, err)
	h.Before("WriteBound", failTimes(100, errInjected))
	treq := nodealloc.Request{Pool: "dual", Owner: dst, Sticky: req.Sticky}
	wctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	_, err = b.alloc.Allocate(wctx, treq)
	require.Error(t, err)
	bd, ok, err := a.store.GetBinding(ctx, "dual", "ns/vm-0")
	require.NoError(t, err)
	require.True(t, ok, "the binding went with the failed ADD")
	require.Equal(t, dst.Key(), bd.Owner.Key())
	als := storeIPs(t, a.cli, "dual")
	require.Len(t, als, 2, "the running pod's addresses were given back")
	for _, al := range als {
		require.Equal(t, dst.Key(), al.Owner.Key())
	}
}

// TestMigrationSourceAddRetriedGetsNoNewFamily: a VM's identity holds
// one family only (its pod's ADD asked for IPv6; or its IPv4 record was
// lost and the pool was disabled when its pod took the rest back), a
// target is admitted as the second owner of that address, and the
// source's ADD is retried asking for both families. It gets what the
// binding names and nothing new: a new address would be named by no
// alternate while the binding, rewritten to name it, would have to drop
// the alternate the other records still name (found by the model test,
// TestModelSimulated seed 1796279100188667178 at step 730007).
func TestMigrationSourceAddRetriedGetsNoNewFamily(t *testing.T) {
	ctx := context.Background()
	e := startEtcd(t, dualPool)
	a := startNode(t, e, "a", []string{"dual"}, nodeOpts{})
	b := startNode(t, e, "b", []string{"dual"}, nodeOpts{})
	migrationLive(t, a, b)
	src := stickyPod("vm-0", 1)
	req := stickyReq(src, time.Minute)
	req.Pool = "dual"
	first := req
	first.Families = []allocator.Family{allocator.IPv6}
	res, err := a.alloc.Allocate(ctx, first)
	require.NoError(t, err)
	require.Len(t, res.Allocations, 1)
	x := res.Allocations[0].Addr
	dst := records.Owner{ContainerID: "target-1", IfName: "eth0", Namespace: "ns", Pod: "virt-launcher-vm-0-b"}
	_, ok, err := b.alloc.Admit(ctx, nodealloc.Request{Pool: "dual", Owner: dst, Sticky: req.Sticky, Migration: "job-1"})
	require.NoError(t, err)
	require.True(t, ok)

	again, err := a.alloc.Allocate(ctx, req)
	require.NoError(t, err)
	require.Equal(t, []netip.Addr{x}, addrsOfResult(again), "the source's retried ADD during the migration")
	bd, found, err := a.store.GetBinding(ctx, "dual", "ns/vm-0")
	require.NoError(t, err)
	require.True(t, found)
	require.Equal(t, []netip.Addr{x}, bd.Addrs)
	require.NotNil(t, bd.Alternate, "the binding dropped the alternate: %+v", bd)
	ips := storeIPs(t, a.cli, "dual")
	require.Len(t, ips, 1, "no new record: %+v", ips)
	require.NotNil(t, ips[0].Alternate)
}

func addrsOfResult(r nodealloc.Result) []netip.Addr {
	var out []netip.Addr
	for _, al := range r.Allocations {
		out = append(out, al.Addr)
	}
	return out
}
