package storetest

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
)

var poolTests = []test{
	{"pools/ensure-get-list", func(t *testing.T, f *fixture) {
		require.Positive(t, f.pool.Rev)
		got, err := f.Store.GetPool(f.ctx, "p")
		require.NoError(t, err)
		require.Equal(t, f.pool, got)
		// The same spec again writes nothing.
		again, err := f.Store.EnsurePool(f.ctx, testPool("p", "10.0.0.0/24"))
		require.NoError(t, err)
		require.Equal(t, f.pool.Rev, again.Rev)
		// A second pool, listed by name.
		q, err := f.Store.EnsurePool(f.ctx, testPool("a", "10.1.0.0/24"))
		require.NoError(t, err)
		require.Greater(t, q.Rev, f.pool.Rev)
		list, err := f.Store.ListPools(f.ctx)
		require.NoError(t, err)
		require.Equal(t, []allocator.Pool{q, f.pool}, list)
		_, err = f.Store.GetPool(f.ctx, "none")
		require.ErrorIs(t, err, records.ErrPoolNotFound)
	}},
	{"pools/ensure-updates-and-keeps-operator-settings", func(t *testing.T, f *fixture) {
		// An operator's settings (disabled, a node selector) stay when a
		// configuration ensures the pool without them.
		sel := testPool("p", "10.0.0.0/24")
		sel.NodeSelector = "rack=r1"
		p, err := f.Store.EnsurePool(f.ctx, sel)
		require.NoError(t, err)
		require.Greater(t, p.Rev, f.pool.Rev)
		require.Equal(t, "rack=r1", p.NodeSelector)
		again, err := f.Store.EnsurePool(f.ctx, testPool("p", "10.0.0.0/24"))
		require.NoError(t, err)
		require.Equal(t, p.Rev, again.Rev, "nothing to change")
		require.Equal(t, "rack=r1", again.NodeSelector)
		// A cidr added is a change; a block size changed is refused.
		grown := testPool("p", "10.0.0.0/24")
		grown.CIDRs = append(grown.CIDRs, netipPrefix("10.0.1.0/24"))
		g, err := f.Store.EnsurePool(f.ctx, grown)
		require.NoError(t, err)
		require.Len(t, g.CIDRs, 2)
		resized := grown
		resized.BlockSizeV4 = 27
		_, err = f.Store.EnsurePool(f.ctx, resized)
		require.Error(t, err)
		got, err := f.Store.GetPool(f.ctx, "p")
		require.NoError(t, err)
		require.Equal(t, g.Rev, got.Rev)
		require.Equal(t, 28, got.BlockSizeV4)
	}},
	{"pools/overlap-and-invalid-refused", func(t *testing.T, f *fixture) {
		_, err := f.Store.EnsurePool(f.ctx, testPool("q", "10.0.0.128/25"))
		require.ErrorIs(t, err, allocator.ErrPoolOverlap)
		_, _, err = f.Store.SeedPool(f.ctx, testPool("q", "10.0.0.128/25"))
		require.ErrorIs(t, err, allocator.ErrPoolOverlap)
		_, err = f.Store.EnsurePool(f.ctx, allocator.Pool{Name: "bad name"})
		require.ErrorIs(t, err, allocator.ErrInvalidPool)
		list, err := f.Store.ListPools(f.ctx)
		require.NoError(t, err)
		require.Len(t, list, 1)
	}},
	{"pools/seed", func(t *testing.T, f *fixture) {
		// A stored pool is never changed by a seed.
		other := testPool("p", "10.0.0.0/24")
		other.NodeSelector = "x=y"
		stored, created, err := f.Store.SeedPool(f.ctx, other)
		require.NoError(t, err)
		require.False(t, created)
		require.Equal(t, f.pool, stored)
		q, created, err := f.Store.SeedPool(f.ctx, testPool("q", "10.2.0.0/24"))
		require.NoError(t, err)
		require.True(t, created)
		require.Greater(t, q.Rev, f.pool.Rev)
		got, err := f.Store.GetPool(f.ctx, "q")
		require.NoError(t, err)
		require.Equal(t, q, got)
	}},
}
