package nodealloc_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/allocator/schema"
	"github.com/kvipam/kvipam/internal/testsupport/agenttest"
)

// vmLauncher is launcher pod gen of VM ns/vm1 in pool one, marked as a
// migration's target when migration is set.
func vmLauncher(gen, migration string) nodealloc.Request {
	o := records.Owner{ContainerID: "launcher-" + gen, IfName: "eth0", Namespace: "ns", Pod: "virt-launcher-vm1-" + gen}
	return nodealloc.Request{Pool: "one", Owner: o, Sticky: &records.Sticky{Identity: "ns/vm1", Window: time.Hour}, Migration: migration}
}

// TestMigrationOwnerDelUnknownToItsNode: a migration cut over to the
// target while the target's node did not hear of it (cut off from etcd;
// an operator's kvipamctl ip migrate --cut-over, or the source's DEL
// handing over) leaves that node's cache believing the records are the
// source's. The target pod's DEL there must still leave nothing of it
// behind: its addresses are kept for the identity, as any sticky pod's
// DEL keeps them, and the VM's next pod gets them. (The chaos run with
// migrations found the DEL answered success having done nothing: the
// binding and the record named the gone pod to the end, and every later
// pod of the VM was refused, "two live pods cannot share one identity".)
func TestMigrationOwnerDelUnknownToItsNode(t *testing.T) {
	ctx := context.Background()
	e := startEtcd(t, onePool)
	// Nodes with their node records (agenttest), so that the schema
	// level can be raised to the migration's.
	a := agenttest.Start(t, e, "a", agenttest.Options{Pools: []string{"one"}})
	b := agenttest.Start(t, e, "b", agenttest.Options{Pools: []string{"one"}})
	_, _, err := a.Store.RaiseSchema(ctx, schema.Highest(), "a", "test")
	require.NoError(t, err)
	src, dst := vmLauncher("src", ""), vmLauncher("dst", "job-1")
	res, err := a.Alloc.Allocate(ctx, src)
	require.NoError(t, err)
	x := res.Allocations[0].Addr
	_, ok, err := b.Alloc.Admit(ctx, dst)
	require.NoError(t, err)
	require.True(t, ok)

	// An operator cuts over; b, cut off, hears nothing of it. The
	// source's DEL on a drops it as the alternate.
	_, err = a.Store.CutOverIdentity(ctx, "one", "ns/vm1")
	require.NoError(t, err)
	_, err = a.Alloc.ReleaseAs(ctx, src.Owner, "ns/vm1")
	require.NoError(t, err)
	bd, _, err := a.Store.GetBinding(ctx, "one", "ns/vm1")
	require.NoError(t, err)
	require.Equal(t, dst.Owner.Key(), bd.Owner.Key(), "the target forwards, alone")
	require.Nil(t, bd.Alternate)

	// The target pod goes, on b.
	_, err = b.Alloc.ReleaseAs(ctx, dst.Owner, "ns/vm1")
	require.NoError(t, err)
	bd, _, err = a.Store.GetBinding(ctx, "one", "ns/vm1")
	require.NoError(t, err)
	require.True(t, bd.Kept(), "the target's DEL keeps the addresses for the identity; the binding names %s", bd.Owner.Key())
	hist, err := a.Store.History(ctx, etcdstore.HistoryFilter{Pool: "one", IP: x})
	require.NoError(t, err)
	require.Equal(t, etcdstore.EndKept, hist[len(hist)-1].Reason, "IP history ends the target's interval at its DEL")
	require.Equal(t, dst.Owner.ContainerID, hist[len(hist)-1].ContainerID)

	// The VM starts again, on either node: its address.
	res, err = a.Alloc.Allocate(ctx, vmLauncher("next", ""))
	require.NoError(t, err)
	require.Equal(t, x, res.Allocations[0].Addr)
}

// TestMigrationReassertAfterCutOverAway: an operator's cut-over moves
// the VM to the target's node; before the source's node hears of it (its
// watch of bindings), its endpoints are compared with etcd (the
// reconciler's pass, etcd answering again). The source pod is the
// migration's alternate now, which etcd's record names: no conflict to
// report (the chaos run with migrations found the source's node writing
// a lost endpoint into its node record, which kvipamctl check listed to
// the end), nothing written back, and the cache learns who forwards.
func TestMigrationReassertAfterCutOverAway(t *testing.T) {
	ctx := context.Background()
	e := startEtcd(t, onePool)
	a := agenttest.Start(t, e, "a", agenttest.Options{Pools: []string{"one"}})
	b := agenttest.Start(t, e, "b", agenttest.Options{Pools: []string{"one"}})
	_, _, err := a.Store.RaiseSchema(ctx, schema.Highest(), "a", "test")
	require.NoError(t, err)
	src, dst := vmLauncher("src", ""), vmLauncher("dst", "job-1")
	res, err := a.Alloc.Allocate(ctx, src)
	require.NoError(t, err)
	x := res.Allocations[0].Addr
	_, ok, err := b.Alloc.Admit(ctx, dst)
	require.NoError(t, err)
	require.True(t, ok)
	_, err = a.Store.CutOverIdentity(ctx, "one", "ns/vm1")
	require.NoError(t, err)

	restored, conflicts, err := a.Alloc.Reassert(ctx, []nodealloc.HeldAddr{{Owner: src.Owner, Addr: x, Identity: "ns/vm1", WindowSeconds: 3600}})
	require.NoError(t, err)
	require.Empty(t, conflicts, "the source is the migration's alternate: no conflict")
	require.Empty(t, restored)
	require.Empty(t, a.Alloc.Lookup(src.Owner), "the source's node learned that the target forwards")
	bd, _, err := a.Store.GetBinding(ctx, "one", "ns/vm1")
	require.NoError(t, err)
	require.Equal(t, dst.Owner.Key(), bd.Owner.Key())
	require.Equal(t, src.Owner.Key(), bd.Alternate.Owner.Key(), "nothing written")
}
