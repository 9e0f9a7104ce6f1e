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
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// TestClaimTakesFirstFreeCandidate: one claim transaction passes over
// candidates another node claimed or that hold allocations, takes the
// first free one with its first address, and explains each one passed
// over; with none free it takes nothing and explains every one. A
// candidate already claimed on the claimant's lease (its own claim whose
// answer was lost) makes the transaction take nothing else, even a free
// candidate before it.
func TestClaimTakesFirstFreeCandidate(t *testing.T) {
	ctx := context.Background()
	cli := etcdtest.Client(t, etcdtest.Start(t))
	st := etcdstore.New(cli, etcdstore.Options{})
	p, err := st.EnsurePool(ctx, allocator.Pool{Name: "p", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/24")}, BlockSizeV4: 28})
	require.NoError(t, err)
	lease := func() int64 {
		l, err := cli.Grant(ctx, 60)
		require.NoError(t, err)
		return int64(l.ID)
	}
	mine, theirs := lease(), lease()
	blk := func(s string) netip.Prefix { return netip.MustParsePrefix(s) }
	first := func(b netip.Prefix, owner string) *records.IPWrite {
		return &records.IPWrite{Pool: "p", Block: b, Addr: b.Addr().Next(), Record: records.Record{
			Owner: records.Owner{ContainerID: owner, IfName: "eth0"}, Node: "n1", State: records.StateAllocated, Since: time.Now().UTC()}}
	}
	claim := func(node string, l int64, bs ...netip.Prefix) (records.ClaimResult, error) {
		cands := make([]records.Candidate, len(bs))
		for i, b := range bs {
			cands[i] = records.Candidate{Block: b, First: first(b, "pod-"+node)}
		}
		return st.Claim(ctx, "p", cands, records.Claim{Node: node, ClaimedAt: time.Now().UTC(), PoolRev: p.Rev}, l)
	}
	taken, orphan, free, spare := blk("10.0.0.0/28"), blk("10.0.0.16/28"), blk("10.0.0.32/28"), blk("10.0.0.48/28")
	_, err = claim("n2", theirs, taken)
	require.NoError(t, err)
	_, err = cli.Put(ctx, etcdstore.IPKey("p", orphan, orphan.Addr().Next()), `{"owner":{"containerID":"x","ifName":"eth0"},"node":"n3","state":"allocated"}`)
	require.NoError(t, err)

	res, err := claim("n1", mine, taken, orphan, free, spare)
	require.NoError(t, err)
	require.Equal(t, 2, res.Won, "the first free candidate is taken")
	require.NotZero(t, res.Rev)
	require.Len(t, res.Lost, 2)
	require.Equal(t, taken, res.Lost[0].Block)
	require.Equal(t, "n2", res.Lost[0].ClaimedBy)
	require.Equal(t, orphan, res.Lost[1].Block)
	require.True(t, res.Lost[1].NonEmpty)
	require.Empty(t, res.Lost[1].ClaimedBy)
	ips := func(b netip.Prefix) int64 {
		r, err := cli.Get(ctx, etcdstore.BlockIPsPrefix("p", b), clientv3.WithPrefix(), clientv3.WithCountOnly())
		require.NoError(t, err)
		return r.Count
	}
	require.EqualValues(t, 1, ips(free), "the taken candidate's first address is written with its claim")
	require.EqualValues(t, 0, ips(spare), "nothing is written past the one taken")
	got, err := cli.Get(ctx, etcdstore.ClaimKey("p", free))
	require.NoError(t, err)
	require.Len(t, got.Kvs, 1)
	require.Equal(t, mine, got.Kvs[0].Lease)
	require.Equal(t, res.Rev, got.Kvs[0].ModRevision)

	// None free: nothing taken, every candidate explained.
	_, err = claim("n3", lease(), taken, orphan, free)
	var ces records.ClaimErrors
	require.ErrorAs(t, err, &ces)
	require.Len(t, ces, 3)
	require.Equal(t, "n1", ces[2].ClaimedBy)
	var ce *records.ClaimError
	require.ErrorAs(t, err, &ce)
	require.Equal(t, taken, ce.Block, "errors.As finds the first candidate's")
	require.ErrorIs(t, err, records.ErrConflict)

	// Retried after a lost answer: a candidate already on this lease is
	// reported as the caller's own, and the free one before it is left.
	res, err = claim("n1", mine, spare, free)
	require.ErrorAs(t, err, &ces)
	require.Equal(t, -1, res.Won)
	require.Len(t, ces, 1, "only the candidates on the lease are explained")
	require.Equal(t, free, ces[0].Block)
	require.Equal(t, "n1", ces[0].ClaimedBy)
	require.Equal(t, mine, ces[0].ClaimLease)
	got, err = cli.Get(ctx, etcdstore.ClaimKey("p", spare))
	require.NoError(t, err)
	require.Empty(t, got.Kvs, "a retried claim takes no second block beside its own")

	// A changed pool refuses every candidate.
	spec, err := cli.Get(ctx, etcdstore.PoolKey("p"))
	require.NoError(t, err)
	require.Len(t, spec.Kvs, 1)
	_, err = cli.Put(ctx, etcdstore.PoolKey("p"), string(spec.Kvs[0].Value))
	require.NoError(t, err)
	_, err = claim("n4", lease(), spare)
	require.ErrorAs(t, err, &ce)
	require.True(t, ce.PoolChanged)

	_, err = st.Claim(ctx, "p", make([]records.Candidate, records.MaxCandidates+1), records.Claim{Node: "n1"}, mine)
	require.ErrorIs(t, err, records.ErrBadRequest)
	_, err = st.Claim(ctx, "p", nil, records.Claim{Node: "n1"}, mine)
	require.ErrorIs(t, err, records.ErrBadRequest)
}
