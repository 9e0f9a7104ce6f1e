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
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

func TestEnsurePool(t *testing.T) {
	ctx := context.Background()
	st := etcdstore.New(etcdtest.Client(t, etcdtest.Start(t)), etcdstore.Options{})
	p := allocator.Pool{Name: "p", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/16")}, BlockSizeV4: 26}
	_, err := st.EnsurePool(ctx, p)
	require.NoError(t, err)
	_, err = st.EnsurePool(ctx, p)
	require.NoError(t, err, "ensuring the same pool again is a no-op")

	grown := p
	grown.CIDRs = append(grown.CIDRs, netip.MustParsePrefix("10.1.0.0/16"))
	_, err = st.EnsurePool(ctx, grown)
	require.NoError(t, err, "adding a CIDR is allowed")

	resized := grown
	resized.BlockSizeV4 = 24
	_, err = st.EnsurePool(ctx, resized)
	require.ErrorIs(t, err, allocator.ErrBlockSizeImmutable)

	shrunk := p
	_, err = st.EnsurePool(ctx, shrunk)
	require.ErrorIs(t, err, allocator.ErrCIDRRemoved)

	got, err := st.GetPool(ctx, "p")
	require.NoError(t, err)
	require.NotZero(t, got.Rev, "a pool read carries its revision, which fences claims")
	got.Rev = 0
	require.Equal(t, grown, got)
	_, err = st.GetPool(ctx, "nope")
	require.ErrorIs(t, err, records.ErrPoolNotFound)

	other := allocator.Pool{Name: "other", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.1.128.0/24")}, BlockSizeV4: 26}
	_, err = st.EnsurePool(ctx, other)
	require.ErrorIs(t, err, allocator.ErrPoolOverlap, "a pool may not share addresses with another")

	bad := allocator.Pool{Name: "bad", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/24"), netip.MustParsePrefix("10.0.0.128/25")}, BlockSizeV4: 26}
	_, err = st.EnsurePool(ctx, bad)
	require.ErrorContains(t, err, "overlap")
}

// TestConcurrentOverlappingPools races two overlapping pools: exactly one
// is created.
func TestConcurrentOverlappingPools(t *testing.T) {
	ctx := context.Background()
	e := etcdtest.Start(t)
	for round := range 10 {
		errs := make(chan error, 2)
		for i := range 2 {
			go func() {
				st := etcdstore.New(etcdtest.Client(t, e), etcdstore.Options{})
				p := allocator.Pool{Name: fmt.Sprintf("r%d-%d", round, i), CIDRs: []netip.Prefix{netip.MustParsePrefix(fmt.Sprintf("10.%d.0.0/24", round))}, BlockSizeV4: 26}
				_, err := st.EnsurePool(ctx, p)
				errs <- err
			}()
		}
		e1, e2 := <-errs, <-errs
		require.True(t, (e1 == nil) != (e2 == nil), "round %d: exactly one of two overlapping pools is created (%v, %v)", round, e1, e2)
	}
}

// TestStoppedEtcdIsUnavailable stops etcd under a store: its calls fail with
// an error that matches retry.ErrUnavailable (try again), whatever gRPC
// or etcd said underneath.
func TestStoppedEtcdIsUnavailable(t *testing.T) {
	e := etcdtest.Start(t)
	cli := etcdtest.Client(t, e)
	s := etcdstore.New(cli, etcdstore.Options{})
	ctx := context.Background()
	_, err := s.EnsurePool(ctx, allocator.Pool{Name: "p", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.9.0.0/24")}, BlockSizeV4: 28})
	require.NoError(t, err)
	require.NoError(t, s.Ping(ctx))
	e.Close()
	for name, call := range map[string]func(ctx context.Context) error{
		"Ping":       s.Ping,
		"ListBlocks": func(ctx context.Context) error { _, err := s.ListBlocks(ctx, "p"); return err },
		"GetPool":    func(ctx context.Context) error { _, err := s.GetPool(ctx, "p"); return err },
		"ListIPs": func(ctx context.Context) error {
			_, err := s.ListIPs(ctx, "p", netip.MustParsePrefix("10.9.0.0/28"))
			return err
		},
	} {
		cctx, cancel := context.WithTimeout(ctx, time.Second)
		err := call(cctx)
		cancel()
		require.ErrorIs(t, err, retry.ErrUnavailable, "%s: %v", name, err)
	}
}
