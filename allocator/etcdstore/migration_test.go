package etcdstore_test

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/allocator/schema"
	"github.com/kvipam/kvipam/internal/testsupport/agenttest"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// vm is launcher pod gen of VM ns/vm1, marked as a migration's target
// when migration is set.
func vm(pool, gen, migration string) nodealloc.Request {
	o := records.Owner{ContainerID: "launcher-" + gen, IfName: "eth0", Namespace: "ns", Pod: "virt-launcher-vm1-" + gen}
	return nodealloc.Request{Pool: pool, Owner: o, Sticky: &records.Sticky{Identity: "ns/vm1", Window: time.Hour}, Migration: migration}
}

// TestMigrationNeedsSchemaLevel: a migration's second owner is written
// only while the cluster's schema level includes migration-owner (level
// 3): an agent that does not know it would free the addresses at the
// source's DEL while the target runs. While one is in progress, a
// downgrade below level 3 is refused, naming it; once it ends, allowed.
func TestMigrationNeedsSchemaLevel(t *testing.T) {
	ctx := context.Background()
	e := etcdtest.Start(t)
	pool := allocator.Pool{Name: "vms", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.21.0.0/24")}, BlockSizeV4: 28}
	agenttest.EnsurePool(t, e, pool)
	a := agenttest.Start(t, e, "a", agenttest.Options{Pools: []string{pool.Name}})
	b := agenttest.Start(t, e, "b", agenttest.Options{Pools: []string{pool.Name}})
	res, err := a.Alloc.Allocate(ctx, vm(pool.Name, "src", ""))
	require.NoError(t, err)
	x := res.Allocations[0].Addr

	// Level 1 (nothing raised it): refused, nothing written.
	_, _, err = b.Alloc.Admit(ctx, vm(pool.Name, "dst", "job-1"))
	require.ErrorIs(t, err, etcdstore.ErrSchemaLevel)
	require.ErrorContains(t, err, schema.MigrationOwner)
	bd, ok, err := a.Store.GetBinding(ctx, pool.Name, "ns/vm1")
	require.NoError(t, err)
	require.True(t, ok)
	require.Nil(t, bd.Alternate, "a refused admission writes nothing")

	_, raised, err := a.Store.RaiseSchema(ctx, schema.Highest(), "a", "test")
	require.NoError(t, err)
	require.True(t, raised)
	got, ok, err := b.Alloc.Admit(ctx, vm(pool.Name, "dst", "job-1"))
	require.NoError(t, err)
	require.True(t, ok)
	require.True(t, got.Alternate)
	require.Equal(t, x, got.Allocations[0].Addr)

	inUse, err := a.Store.ValidateDowngrade(ctx, 2)
	require.NoError(t, err)
	require.Len(t, inUse, 1)
	require.Contains(t, inUse[0].String(), "the live migration of ns/vm1")
	_, err = a.Store.EnableDowngrade(ctx, 2, "v0.1.9")
	require.ErrorIs(t, err, etcdstore.ErrSchemaLevel)
	require.ErrorContains(t, err, "the live migration of ns/vm1")

	// The target leaves (its DEL): the migration ends, the downgrade may go.
	_, err = b.Alloc.ReleaseAs(ctx, vm(pool.Name, "dst", "").Owner, "ns/vm1")
	require.NoError(t, err)
	bd, _, err = a.Store.GetBinding(ctx, pool.Name, "ns/vm1")
	require.NoError(t, err)
	require.Nil(t, bd.Alternate)
	require.Equal(t, "launcher-src", bd.Owner.ContainerID, "the source holds the identity on")
	_, err = a.Store.EnableDowngrade(ctx, 2, "v0.1.9")
	require.NoError(t, err)
	_, _, err = b.Alloc.Admit(ctx, vm(pool.Name, "dst2", "job-2"))
	require.ErrorIs(t, err, etcdstore.ErrSchemaLevel, "held below the level by the downgrade")
	require.ErrorContains(t, err, "downgrade")
}

// TestMigrationCutOverMovesTheRoute: the cut-over makes the target the
// owner and its node the address's home (a lent home naming it, x being
// in the source's block); a cut-over back to the block's own node takes
// the lent home away. The IP history ends each forwarding owner's
// interval as migrated, and the second owner's as alternate-ended.
func TestMigrationCutOverMovesTheRoute(t *testing.T) {
	ctx := context.Background()
	e := etcdtest.Start(t)
	pool := allocator.Pool{Name: "vms", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.22.0.0/24")}, BlockSizeV4: 28}
	agenttest.EnsurePool(t, e, pool)
	a := agenttest.Start(t, e, "a", agenttest.Options{Pools: []string{pool.Name}})
	b := agenttest.Start(t, e, "b", agenttest.Options{Pools: []string{pool.Name}})
	_, _, err := a.Store.RaiseSchema(ctx, schema.Highest(), "a", "test")
	require.NoError(t, err)
	src, dst := vm(pool.Name, "src", ""), vm(pool.Name, "dst", "job-1")
	res, err := a.Alloc.Allocate(ctx, src)
	require.NoError(t, err)
	x := res.Allocations[0].Addr
	_, ok, err := b.Alloc.Admit(ctx, dst)
	require.NoError(t, err)
	require.True(t, ok)
	lent := func() map[netip.Addr]string {
		l, err := a.Store.ListLent(ctx, pool.Name)
		require.NoError(t, err)
		return l
	}
	require.Empty(t, lent(), "before the cut-over x routes with its block, to a")

	require.NoError(t, b.Alloc.CutOver(ctx, pool.Name, "ns/vm1", dst.Owner))
	require.NoError(t, b.Alloc.CutOver(ctx, pool.Name, "ns/vm1", dst.Owner), "a cut-over done already succeeds")
	require.Equal(t, map[netip.Addr]string{x: "b"}, lent(), "x routes to b, the target's node")
	bd, _, err := a.Store.GetBinding(ctx, pool.Name, "ns/vm1")
	require.NoError(t, err)
	require.Equal(t, "b", bd.Node)
	require.Equal(t, dst.Owner.Key(), bd.Owner.Key())
	require.Equal(t, src.Owner.Key(), bd.Alternate.Owner.Key(), "the source is the second owner until its DEL")
	require.Len(t, b.Alloc.Lookup(dst.Owner), 1, "the target's node holds x in its cache")
	err = a.Alloc.CutOver(ctx, pool.Name, "ns/vm1", vm(pool.Name, "third", "").Owner)
	require.ErrorIs(t, err, records.ErrMigration, "a pod neither owner nor second owner cannot cut over")

	// Back to a (its own block): x routes with its block again.
	require.NoError(t, a.Alloc.CutOver(ctx, pool.Name, "ns/vm1", src.Owner))
	require.Empty(t, lent())
	_, err = b.Alloc.ReleaseAs(ctx, dst.Owner, "ns/vm1")
	require.NoError(t, err)
	h, err := a.Store.History(ctx, etcdstore.HistoryFilter{Pool: pool.Name, IP: x})
	require.NoError(t, err)
	var reasons []string
	for _, r := range h {
		reasons = append(reasons, r.ContainerID+":"+r.Reason)
	}
	require.Equal(t, []string{"launcher-src:migrated", "launcher-dst:migrated", "launcher-dst:alternate-ended"}, reasons)
}

// TestMigrationAdmitReplacesAlternateOfGoneNode: an earlier migration's
// target whose node went (no live record, its pod gone without a DEL)
// does not block the VM's next migration; a live one does.
func TestMigrationAdmitReplacesAlternateOfGoneNode(t *testing.T) {
	ctx := context.Background()
	e := etcdtest.Start(t)
	pool := allocator.Pool{Name: "vms", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.23.0.0/24")}, BlockSizeV4: 28}
	agenttest.EnsurePool(t, e, pool)
	a := agenttest.Start(t, e, "a", agenttest.Options{Pools: []string{pool.Name}})
	b := agenttest.Start(t, e, "b", agenttest.Options{Pools: []string{pool.Name}})
	c := agenttest.Start(t, e, "c", agenttest.Options{Pools: []string{pool.Name}})
	_, _, err := a.Store.RaiseSchema(ctx, schema.Highest(), "a", "test")
	require.NoError(t, err)
	_, err = a.Alloc.Allocate(ctx, vm(pool.Name, "src", ""))
	require.NoError(t, err)
	_, ok, err := b.Alloc.Admit(ctx, vm(pool.Name, "dst", "job-1"))
	require.NoError(t, err)
	require.True(t, ok)

	_, _, err = c.Alloc.Admit(ctx, vm(pool.Name, "dst2", "job-2"))
	require.ErrorIs(t, err, records.ErrIdentityInUse, "b is live: its migration is in progress")
	require.ErrorContains(t, err, "a third pod cannot join")

	b.Kill(t) // its node record goes with its lease
	_, ok, err = c.Alloc.Admit(ctx, vm(pool.Name, "dst2", "job-2"))
	require.NoError(t, err)
	require.True(t, ok)
	bd, _, err := a.Store.GetBinding(ctx, pool.Name, "ns/vm1")
	require.NoError(t, err)
	require.Equal(t, "c", bd.Alternate.Node)
	require.Equal(t, "job-2", bd.Alternate.Migration)
}
