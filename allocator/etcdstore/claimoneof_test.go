package etcdstore_test

import (
	"context"
	"errors"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// TestClaimOneOf: one transaction claims the first free of several
// blocks, with its first allocation; blocks before it are left as they
// were; when none is free, each candidate says why.
func TestClaimOneOf(t *testing.T) {
	ctx := context.Background()
	cli := etcdtest.Client(t, etcdtest.Start(t))
	st := etcdstore.New(cli, etcdstore.Options{})
	p, err := st.EnsurePool(ctx, allocator.Pool{Name: "p", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/24")}, BlockSizeV4: 28})
	require.NoError(t, err)
	lease, err := cli.Grant(ctx, 30)
	require.NoError(t, err)
	b0, b1, b2 := netip.MustParsePrefix("10.0.0.0/28"), netip.MustParsePrefix("10.0.0.16/28"), netip.MustParsePrefix("10.0.0.32/28")
	claim := func(node string) records.Claim {
		return records.Claim{Node: node, ClaimedAt: time.Now().UTC(), PoolRev: p.Rev}
	}
	_, err = st.Claim(ctx, "p", b0, claim("other"), int64(lease.ID))
	require.NoError(t, err)

	first := func(b netip.Prefix) *records.IPWrite {
		rec := records.Record{Owner: records.Owner{ContainerID: "c1", IfName: "eth0"}, Node: "me", State: records.StateAllocated, Since: time.Now().UTC()}
		return &records.IPWrite{Pool: "p", Block: b, Addr: b.Addr().Next(), Record: rec}
	}
	cands := []records.ClaimCandidate{{Block: b0, First: first(b0)}, {Block: b1, First: first(b1)}, {Block: b2, First: first(b2)}}
	i, rev, err := st.ClaimOneOf(ctx, "p", cands, claim("me"), int64(lease.ID))
	require.NoError(t, err)
	require.Equal(t, 1, i, "the first free candidate")
	got, err := st.ListBlocks(ctx, "p")
	require.NoError(t, err)
	nodes := map[netip.Prefix]string{}
	for _, bi := range got {
		nodes[bi.Block] = bi.Claim.Node
		if bi.Block == b1 {
			require.Equal(t, rev, bi.ClaimRev)
		}
	}
	require.Equal(t, map[netip.Prefix]string{b0: "other", b1: "me"}, nodes, "b0 left as it was, b2 not claimed")
	resp, err := cli.Get(ctx, etcdstore.IPKey("p", b1, b1.Addr().Next()))
	require.NoError(t, err)
	require.Len(t, resp.Kvs, 1, "the first allocation written with the claim")
	require.Equal(t, rev, resp.Kvs[0].ModRevision)
	resp, err = cli.Get(ctx, etcdstore.IPsPrefix("p"), clientv3.WithPrefix(), clientv3.WithCountOnly())
	require.NoError(t, err)
	require.EqualValues(t, 1, resp.Count, "and no other")

	_, _, err = st.ClaimOneOf(ctx, "p", cands[:2], claim("third"), int64(lease.ID))
	var ces records.ClaimsError
	require.ErrorAs(t, err, &ces)
	require.ErrorIs(t, err, records.ErrConflict)
	require.Len(t, ces, 2)
	require.Equal(t, "other", ces[0].ClaimedBy)
	require.Equal(t, "me", ces[1].ClaimedBy)
	require.True(t, ces[1].NonEmpty)
	var ce *records.ClaimError
	require.True(t, errors.As(err, &ce))

	stale := claim("third")
	stale.PoolRev = p.Rev - 1
	_, _, err = st.ClaimOneOf(ctx, "p", []records.ClaimCandidate{{Block: b2}, {Block: netip.MustParsePrefix("10.0.0.48/28")}}, stale, int64(lease.ID))
	require.ErrorAs(t, err, &ces)
	require.True(t, ces[0].PoolChanged)
	require.True(t, ces[1].PoolChanged)
}
