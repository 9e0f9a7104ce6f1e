package etcdstore_test

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// TestClaimWithReservationLeases: a claim whose first address is a
// reservation puts two leases in one transaction, the node's (the claim)
// and the shared reservation lease (the address), and etcd's "lease not
// found" does not say which is gone. The reservation lease gone is a lost
// race (the next claim grants a new one); the node's lease gone is
// ErrLeaseLost, never retried as a race.
func TestClaimWithReservationLeases(t *testing.T) {
	ctx := context.Background()
	cli := etcdtest.Client(t, etcdtest.Start(t))
	st := etcdstore.New(cli, etcdstore.Options{ReservationTTL: time.Minute})
	p, err := st.EnsurePool(ctx, allocator.Pool{Name: "p", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/24")}, BlockSizeV4: 28})
	require.NoError(t, err)
	grant := func() int64 {
		l, err := cli.Grant(ctx, 60)
		require.NoError(t, err)
		return int64(l.ID)
	}
	claim := func(b netip.Prefix, node int64) (records.WriteResult, error) {
		w := &records.IPWrite{Pool: "p", Block: b, Addr: b.Addr().Next(), Reserve: true, Record: records.Record{
			Owner: records.Owner{ContainerID: b.String(), IfName: "eth0"}, Node: "n1", State: records.StateReserved, Since: time.Now().UTC()}}
		return st.Claim(ctx, "p", b, records.Claim{Node: "n1", ClaimedAt: time.Now().UTC(), PoolRev: p.Rev, First: w}, node)
	}
	resLease := func(b netip.Prefix) clientv3.LeaseID {
		got, err := cli.Get(ctx, etcdstore.IPKey("p", b, b.Addr().Next()))
		require.NoError(t, err)
		require.Len(t, got.Kvs, 1)
		return clientv3.LeaseID(got.Kvs[0].Lease)
	}
	node := grant()
	b1, b2, b3 := netip.MustParsePrefix("10.0.0.0/28"), netip.MustParsePrefix("10.0.0.16/28"), netip.MustParsePrefix("10.0.0.32/28")
	res, err := claim(b1, node)
	require.NoError(t, err)
	require.False(t, res.Expires.Before(time.Now().Add(59*time.Second)), "the reservation's expiry: %s", res.Expires)
	first := resLease(b1)
	require.NotZero(t, first)
	require.NotEqual(t, clientv3.LeaseID(node), first)

	// The shared reservation lease revoked: a lost race, nothing written.
	_, err = cli.Revoke(ctx, first)
	require.NoError(t, err)
	_, err = claim(b2, node)
	require.ErrorIs(t, err, retry.ErrConflict)
	require.NotErrorIs(t, err, records.ErrLeaseLost)
	got, err := cli.Get(ctx, etcdstore.ClaimKey("p", b2))
	require.NoError(t, err)
	require.Empty(t, got.Kvs)
	// The retry grants a new reservation lease.
	_, err = claim(b2, node)
	require.NoError(t, err)
	require.NotEqual(t, first, resLease(b2))

	// The node's lease revoked: the node lost its lease.
	_, err = cli.Revoke(ctx, clientv3.LeaseID(node))
	require.NoError(t, err)
	_, err = claim(b3, node)
	require.ErrorIs(t, err, records.ErrLeaseLost)
	require.NotErrorIs(t, err, retry.ErrConflict)
}

// TestGetBlocks reads back the claims and homes of the blocks named, as
// ListBlocks lists them; a block with neither is absent.
func TestGetBlocks(t *testing.T) {
	ctx := context.Background()
	cli := etcdtest.Client(t, etcdtest.Start(t))
	st := etcdstore.New(cli, etcdstore.Options{})
	p, err := st.EnsurePool(ctx, allocator.Pool{Name: "p", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/24")}, BlockSizeV4: 28})
	require.NoError(t, err)
	l, err := cli.Grant(ctx, 60)
	require.NoError(t, err)
	b1, b2 := netip.MustParsePrefix("10.0.0.0/28"), netip.MustParsePrefix("10.0.0.16/28")
	res, err := st.Claim(ctx, "p", b1, records.Claim{Node: "n1", ClaimedAt: time.Now().UTC(), PoolRev: p.Rev}, int64(l.ID))
	require.NoError(t, err)
	got, err := st.GetBlocks(ctx, "p", []netip.Prefix{b1, b2})
	require.NoError(t, err)
	require.Len(t, got, 1, "an unclaimed block without a home is absent")
	bi := got[b1]
	require.True(t, bi.Owned("n1"))
	require.Equal(t, res.Rev, bi.ClaimRev)
	require.Equal(t, int64(l.ID), bi.ClaimLease)
	require.Equal(t, "n1", bi.Home.Node)
	all, err := st.ListBlocks(ctx, "p")
	require.NoError(t, err)
	require.Equal(t, all, []records.BlockInfo{bi}, "as ListBlocks has it")
}
