package storetest

import (
	"errors"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
)

var claimTests = []test{
	{"claims/claim-list-get", func(t *testing.T, f *fixture) {
		blocks, err := f.Store.ListBlocks(f.ctx, "p")
		require.NoError(t, err)
		require.Empty(t, blocks)
		revB, leaseB := f.claim(t, "n2", blockB)
		revA, leaseA := f.claim(t, "n1", blockA)
		require.Greater(t, revA, revB)
		blocks, err = f.Store.ListBlocks(f.ctx, "p")
		require.NoError(t, err)
		require.Len(t, blocks, 2)
		byBlock := map[netip.Prefix]records.BlockInfo{}
		for _, bi := range blocks {
			byBlock[bi.Block] = bi
		}
		a := byBlock[blockA]
		require.True(t, a.Owned("n1"))
		require.Equal(t, revA, a.ClaimRev)
		require.Equal(t, leaseA, a.ClaimLease)
		require.Equal(t, "n1", a.Home.Node)
		require.Equal(t, revA, a.HomeRev, "the home is written with the claim")
		require.Equal(t, leaseB, byBlock[blockB].ClaimLease)
		got, err := f.Store.GetBlocks(f.ctx, "p", []netip.Prefix{blockA, blockC})
		require.NoError(t, err)
		require.Equal(t, map[netip.Prefix]records.BlockInfo{blockA: a}, got, "a block with neither claim nor home is absent")
		peeked, err := f.Store.PeekBlocks(f.ctx, "p", []netip.Prefix{blockA, blockC})
		require.NoError(t, err)
		require.Equal(t, got, peeked, "a peek of a quiet store reads what GetBlocks reads")
		other, err := f.Store.ListBlocks(f.ctx, "q")
		require.NoError(t, err)
		require.Empty(t, other)
	}},
	{"claims/lost-race", func(t *testing.T, f *fixture) {
		rev, lease := f.claim(t, "n1", blockA)
		_, err := f.Store.Claim(f.ctx, "p", blockA, records.Claim{Node: "n2"}, f.Grant(time.Minute))
		var ce *records.ClaimError
		require.ErrorAs(t, err, &ce)
		require.ErrorIs(t, err, retry.ErrConflict)
		require.Equal(t, records.ClaimError{Block: blockA, ClaimedBy: "n1", HomeNode: "n1", ClaimRev: rev, ClaimLease: lease}, *ce)
		// Its own claim again (an answer lost): the same error names its lease.
		_, err = f.Store.Claim(f.ctx, "p", blockA, records.Claim{Node: "n1"}, lease)
		require.ErrorAs(t, err, &ce)
		require.Equal(t, lease, ce.ClaimLease)
	}},
	{"claims/pool-changed", func(t *testing.T, f *fixture) {
		stale := f.pool.Rev
		p := testPool("p", "10.0.0.0/24")
		p.NodeSelector = "a=b"
		_, err := f.Store.EnsurePool(f.ctx, p)
		require.NoError(t, err)
		_, err = f.Store.Claim(f.ctx, "p", blockA, records.Claim{Node: "n1", PoolRev: stale}, f.Grant(time.Minute))
		var ce *records.ClaimError
		require.ErrorAs(t, err, &ce)
		require.Equal(t, records.ClaimError{Block: blockA, PoolChanged: true}, *ce)
		_, ok := f.block(t, blockA)
		require.False(t, ok)
		cur, err := f.Store.GetPool(f.ctx, "p")
		require.NoError(t, err)
		_, err = f.Store.Claim(f.ctx, "p", blockA, records.Claim{Node: "n1", PoolRev: cur.Rev}, f.Grant(time.Minute))
		require.NoError(t, err)
		// A pool that does not exist has changed.
		_, err = f.Store.Claim(f.ctx, "gone", blockA, records.Claim{Node: "n1", PoolRev: cur.Rev}, f.Grant(time.Minute))
		require.ErrorAs(t, err, &ce)
		require.True(t, ce.PoolChanged)
	}},
	{"claims/claim-with-first", func(t *testing.T, f *fixture) {
		a := netip.MustParseAddr("10.0.0.1")
		lease := f.Grant(time.Minute)
		first := records.IPWrite{Pool: "p", Block: blockA, Addr: a, Record: f.rec(1, "n1", records.StateReserved), Reserve: true}
		res, err := f.Store.Claim(f.ctx, "p", blockA, records.Claim{Node: "n1", First: &first}, lease)
		require.NoError(t, err)
		near(t, f.Now().Add(2*time.Minute+30*time.Second), res.Expires, "the reservation lease: the TTL and its sharing window")
		al := f.get(t, blockA, a, res.Rev)
		require.Equal(t, first.Record, al.Record)
		require.NotZero(t, al.Lease, "a reservation is on the reservation lease")
		require.NotEqual(t, lease, al.Lease)
		bi, _ := f.block(t, blockA)
		require.Equal(t, res.Rev, bi.ClaimRev)
		// An allocated first address has no lease.
		b := netip.MustParseAddr("10.0.0.17")
		first = records.IPWrite{Pool: "p", Block: blockB, Addr: b, Record: f.rec(2, "n1", records.StateAllocated)}
		res, err = f.Store.Claim(f.ctx, "p", blockB, records.Claim{Node: "n1", First: &first}, lease)
		require.NoError(t, err)
		require.True(t, res.Expires.IsZero())
		require.Zero(t, f.get(t, blockB, b, res.Rev).Lease)
		// A first address outside the block, borrowed or a confirm is refused.
		for _, w := range []records.IPWrite{
			{Pool: "p", Block: blockC, Addr: a, Record: first.Record},
			{Pool: "p", Block: blockC, Addr: netip.MustParseAddr("10.0.0.33"), Record: first.Record, Borrowed: true},
			{Pool: "p", Block: blockC, Addr: netip.MustParseAddr("10.0.0.33"), Record: first.Record, PrevRev: 5},
		} {
			_, err = f.Store.Claim(f.ctx, "p", blockC, records.Claim{Node: "n1", First: &w}, lease)
			require.ErrorIs(t, err, records.ErrBadRequest)
		}
		_, ok := f.block(t, blockC)
		require.False(t, ok)
	}},
	{"claims/lease-gone", func(t *testing.T, f *fixture) {
		lease := f.Grant(time.Minute)
		f.Revoke(lease)
		_, err := f.Store.Claim(f.ctx, "p", blockA, records.Claim{Node: "n1"}, lease)
		require.ErrorIs(t, err, records.ErrLeaseLost)
		require.False(t, errors.Is(err, retry.ErrConflict) || errors.Is(err, retry.ErrUnavailable), "%v", err)
		_, ok := f.block(t, blockA)
		require.False(t, ok, "nothing written")
	}},
	{"claims/orphan-and-reclaim", func(t *testing.T, f *fixture) {
		rev, lease := f.claim(t, "n1", blockA)
		a := netip.MustParseAddr("10.0.0.2")
		f.write(t, blockA, rev, a, f.rec(1, "n1", records.StateAllocated), false)
		f.Revoke(lease)
		// The claim went with the lease; the home and the allocation stay.
		prev, ok := f.block(t, blockA)
		require.True(t, ok)
		require.Nil(t, prev.Claim)
		require.Equal(t, "n1", prev.Home.Node)
		f.get(t, blockA, a, 0)
		// Orphaned, never free: no other node claims it.
		_, err := f.Store.Claim(f.ctx, "p", blockA, records.Claim{Node: "n2"}, f.Grant(time.Minute))
		var ce *records.ClaimError
		require.ErrorAs(t, err, &ce)
		require.Equal(t, records.ClaimError{Block: blockA, NonEmpty: true, HomeNode: "n1"}, *ce)
		_, err = f.Store.Reclaim(f.ctx, "p", prev, records.Claim{Node: "n2"}, f.Grant(time.Minute))
		require.ErrorIs(t, err, records.ErrNotOwned)
		// Its home node takes it back, on a new lease.
		lease2 := f.Grant(time.Minute)
		rev2, err := f.Store.Reclaim(f.ctx, "p", prev, records.Claim{Node: "n1"}, lease2)
		require.NoError(t, err)
		bi, _ := f.block(t, blockA)
		require.Equal(t, rev2, bi.ClaimRev)
		require.Equal(t, lease2, bi.ClaimLease)
		require.Equal(t, prev.HomeRev, bi.HomeRev, "the home is not rewritten")
		// prev is stale now.
		_, err = f.Store.Reclaim(f.ctx, "p", prev, records.Claim{Node: "n1"}, lease2)
		require.ErrorAs(t, err, &ce)
		require.Equal(t, "n1", ce.ClaimedBy)
		// A claim of its own on an older lease moves to the new one.
		lease3 := f.Grant(time.Minute)
		rev3, err := f.Store.Reclaim(f.ctx, "p", bi, records.Claim{Node: "n1"}, lease3)
		require.NoError(t, err)
		require.Greater(t, rev3, rev2)
		bi, _ = f.block(t, blockA)
		require.Equal(t, lease3, bi.ClaimLease)
		// The old lease ending takes nothing now.
		f.Revoke(lease2)
		bi, _ = f.block(t, blockA)
		require.True(t, bi.Owned("n1"))
		// A reclaim on a lease gone is refused as a lost lease.
		f.Revoke(lease3)
		prev, _ = f.block(t, blockA)
		_, err = f.Store.Reclaim(f.ctx, "p", prev, records.Claim{Node: "n1"}, lease3)
		require.ErrorIs(t, err, records.ErrLeaseLost)
	}},
	{"claims/unclaim", func(t *testing.T, f *fixture) {
		rev, _ := f.claim(t, "n1", blockA)
		a := netip.MustParseAddr("10.0.0.3")
		al := f.write(t, blockA, rev, a, f.rec(1, "n1", records.StateAllocated), false)
		require.ErrorIs(t, f.Store.Unclaim(f.ctx, "p", blockA, rev), retry.ErrConflict, "not empty")
		require.NoError(t, f.Store.DeleteIP(f.ctx, al))
		require.ErrorIs(t, f.Store.Unclaim(f.ctx, "p", blockA, rev+100), retry.ErrConflict, "another claim revision")
		require.NoError(t, f.Store.Unclaim(f.ctx, "p", blockA, rev))
		_, ok := f.block(t, blockA)
		require.False(t, ok, "claim and home gone")
		// Free again, for anyone.
		f.claim(t, "n2", blockA)
	}},
}
