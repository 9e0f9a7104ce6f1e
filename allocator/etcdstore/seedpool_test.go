package etcdstore_test

import (
	"context"
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// TestSeedPool: a configured pool is created only when etcd lacks it;
// a stored pool is returned as it is, whatever the configuration says,
// with nothing written; a pool an operator deleted is not created again
// until pool create makes it; overlapping seeds race to one winner.
func TestSeedPool(t *testing.T) {
	ctx := context.Background()
	e := etcdtest.Start(t)
	st := etcdstore.New(etcdtest.Client(t, e), etcdstore.Options{})
	p := allocator.Pool{Name: "p", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/24")}, BlockSizeV4: 28}
	got, created, err := st.SeedPool(ctx, p)
	require.NoError(t, err)
	require.True(t, created)
	require.Equal(t, p.CIDRs, got.CIDRs)

	changed, err := st.UpdatePool(ctx, "p", func(q *allocator.Pool) error {
		q.CIDRs = append(q.CIDRs, netip.MustParsePrefix("10.0.1.0/24"))
		q.NodeSelector = "rack=r1"
		return nil
	})
	require.NoError(t, err)
	got, created, err = st.SeedPool(ctx, p)
	require.NoError(t, err)
	require.False(t, created)
	require.Equal(t, changed.Rev, got.Rev, "nothing written")
	require.Equal(t, changed.CIDRs, got.CIDRs)
	require.Equal(t, "rack=r1", got.NodeSelector)
	require.False(t, allocator.SameSpec(got, p), "the caller sees the difference")

	require.NoError(t, st.DeletePool(ctx, "p"))
	_, _, err = st.SeedPool(ctx, p)
	require.ErrorIs(t, err, etcdstore.ErrPoolDeleted)
	_, err = st.GetPool(ctx, "p")
	require.Error(t, err, "a deleted pool stays deleted")
	_, err = st.EnsurePool(ctx, p)
	require.NoError(t, err, "pool create makes it again")
	_, created, err = st.SeedPool(ctx, p)
	require.NoError(t, err)
	require.False(t, created)
	require.NoError(t, st.DeletePool(ctx, "p"))
	_, err = st.EnsurePool(ctx, p)
	require.NoError(t, err)
	require.NoError(t, st.DeletePool(ctx, "p"))
	_, _, err = st.SeedPool(ctx, p)
	require.ErrorIs(t, err, etcdstore.ErrPoolDeleted, "the mark is written by every delete")

	for round := range 5 {
		errs := make(chan error, 2)
		for i := range 2 {
			go func() {
				s := etcdstore.New(etcdtest.Client(t, e), etcdstore.Options{})
				q := allocator.Pool{Name: fmt.Sprintf("s%d-%d", round, i), CIDRs: []netip.Prefix{netip.MustParsePrefix(fmt.Sprintf("10.%d.0.0/24", 100+round))}, BlockSizeV4: 28}
				_, _, err := s.SeedPool(ctx, q)
				errs <- err
			}()
		}
		e1, e2 := <-errs, <-errs
		require.True(t, (e1 == nil) != (e2 == nil), "round %d: exactly one of two overlapping seeds lands (%v, %v)", round, e1, e2)
	}
}

// TestSeedPoolCooldown: an agent's configured pool may carry its reuse
// cooldown, which seeds a pool etcd lacks and never overrides an
// operator's; pool create again without one keeps the stored one.
func TestSeedPoolCooldown(t *testing.T) {
	ctx := context.Background()
	st := etcdstore.New(etcdtest.Client(t, etcdtest.Start(t)), etcdstore.Options{})
	p := allocator.Pool{Name: "p", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/24")}, BlockSizeV4: 28, ReuseCooldown: allocator.DurationOf(45 * time.Second)}
	got, created, err := st.SeedPool(ctx, p)
	require.NoError(t, err)
	require.True(t, created)
	require.Equal(t, 45*time.Second, got.Cooldown())

	changed, err := st.UpdatePool(ctx, "p", func(q *allocator.Pool) error { q.ReuseCooldown = allocator.DurationOf(0); return nil })
	require.NoError(t, err)
	got, created, err = st.SeedPool(ctx, p)
	require.NoError(t, err)
	require.False(t, created)
	require.Equal(t, changed.Rev, got.Rev, "nothing written")
	require.Zero(t, got.Cooldown(), "the operator's cooldown stays")
	require.False(t, allocator.SameSpec(got, p), "the caller sees the difference")

	plain := p
	plain.ReuseCooldown = nil
	got, err = st.EnsurePool(ctx, plain)
	require.NoError(t, err)
	require.Zero(t, got.Cooldown(), "pool create without a cooldown keeps the stored one")
	_, err = st.UpdatePool(ctx, "p", func(q *allocator.Pool) error { q.ReuseCooldown = allocator.DurationOf(2 * time.Hour); return nil })
	require.ErrorIs(t, err, allocator.ErrInvalidPool)
}
