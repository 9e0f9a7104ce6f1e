package storetest

import (
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator/records"
)

var loanTests = []test{
	{"loans/fence", func(t *testing.T, f *fixture) {
		lease := f.Grant(time.Minute)
		rev, err := f.Store.FenceBorrower(f.ctx, records.Claim{Node: "n1"}, lease)
		require.NoError(t, err)
		require.Positive(t, rev)
		again, err := f.Store.FenceBorrower(f.ctx, records.Claim{Node: "n1"}, lease)
		require.NoError(t, err)
		require.Equal(t, rev, again, "its own fence, found")
		// A new lease of the node (a restart) moves the fence.
		lease2 := f.Grant(time.Minute)
		moved, err := f.Store.FenceBorrower(f.ctx, records.Claim{Node: "n1"}, lease2)
		require.NoError(t, err)
		require.Greater(t, moved, rev)
		other, err := f.Store.FenceBorrower(f.ctx, records.Claim{Node: "n2"}, lease)
		require.NoError(t, err)
		require.Greater(t, other, moved, "each node has its own")
		f.Revoke(lease2)
		_, err = f.Store.FenceBorrower(f.ctx, records.Claim{Node: "n1"}, lease2)
		require.ErrorIs(t, err, records.ErrLeaseLost)
	}},
	{"loans/borrow-and-give-back", func(t *testing.T, f *fixture) {
		f.claim(t, "lender", blockA)
		lease := f.Grant(time.Minute)
		fence, err := f.Store.FenceBorrower(f.ctx, records.Claim{Node: "n1"}, lease)
		require.NoError(t, err)
		a := netip.MustParseAddr("10.0.0.5")
		rec := f.rec(1, "n1", records.StateAllocated)
		rec.Borrowed = true
		w := records.IPWrite{Pool: "p", Block: blockA, ClaimRev: fence, Addr: a, Record: rec, Borrowed: true}
		res, err := f.Store.WriteIPs(f.ctx, []records.IPWrite{w})
		require.NoError(t, err)
		al := f.get(t, blockA, a, res.Rev)
		require.True(t, al.Borrowed)
		lent, err := f.Store.ListLent(f.ctx, "p")
		require.NoError(t, err)
		require.Equal(t, map[netip.Addr]string{a: "n1"}, lent)
		blocks, err := f.Store.ListBlocks(f.ctx, "p")
		require.NoError(t, err)
		require.Len(t, blocks, 1, "a lent address's home is not a block")
		got, err := f.Store.GetBlocks(f.ctx, "p", []netip.Prefix{blockA, netip.PrefixFrom(a, 32)})
		require.NoError(t, err)
		require.Len(t, got, 1)
		// Taken by the same write again.
		_, err = f.Store.WriteIPs(f.ctx, []records.IPWrite{w})
		var we *records.WriteError
		require.ErrorAs(t, err, &we)
		require.Equal(t, records.WriteError{Taken: []netip.Addr{a}}, *we)
		// Released, the address's home goes with it.
		require.NoError(t, f.Store.DeleteIP(f.ctx, al))
		lent, err = f.Store.ListLent(f.ctx, "p")
		require.NoError(t, err)
		require.Empty(t, lent)
		// A reserved borrow: the address and its home on the reservation
		// lease, and a confirm detaches both.
		w.Reserve = true
		res, err = f.Store.WriteIPs(f.ctx, []records.IPWrite{w})
		require.NoError(t, err)
		al = f.get(t, blockA, a, res.Rev)
		require.NotZero(t, al.Lease)
		snap, err := f.Store.PoolSnapshot(f.ctx, "p")
		require.NoError(t, err)
		require.Equal(t, map[netip.Addr]string{a: "n1"}, snap.Lent)
		require.Equal(t, []records.UsedAddr{{Addr: a, Lease: al.Lease}}, snap.Used[blockA])
		conf := w
		conf.PrevRev, conf.Reserve = al.Rev, false
		_, err = f.Store.WriteIPs(f.ctx, []records.IPWrite{conf})
		require.NoError(t, err)
		f.Revoke(al.Lease)
		f.get(t, blockA, a, 0)
		lent, err = f.Store.ListLent(f.ctx, "p")
		require.NoError(t, err)
		require.Equal(t, map[netip.Addr]string{a: "n1"}, lent, "the home outlives the reservation lease once confirmed")
	}},
	{"loans/reserved-borrow-lapses", func(t *testing.T, f *fixture) {
		f.claim(t, "lender", blockA)
		fence, err := f.Store.FenceBorrower(f.ctx, records.Claim{Node: "n1"}, f.Grant(time.Minute))
		require.NoError(t, err)
		a := netip.MustParseAddr("10.0.0.6")
		rec := f.rec(1, "n1", records.StateReserved)
		rec.Borrowed = true
		res, err := f.Store.WriteIPs(f.ctx, []records.IPWrite{{Pool: "p", Block: blockA, ClaimRev: fence, Addr: a, Record: rec, Borrowed: true, Reserve: true}})
		require.NoError(t, err)
		f.Revoke(f.get(t, blockA, a, res.Rev).Lease)
		f.absent(t, blockA, a)
		lent, err := f.Store.ListLent(f.ctx, "p")
		require.NoError(t, err)
		require.Empty(t, lent, "the home lapses with the reservation")
	}},
	{"loans/borrow-fences", func(t *testing.T, f *fixture) {
		_, lenderLease := f.claim(t, "lender", blockA)
		lease := f.Grant(time.Minute)
		fence, err := f.Store.FenceBorrower(f.ctx, records.Claim{Node: "n1"}, lease)
		require.NoError(t, err)
		rec := f.rec(1, "n1", records.StateAllocated)
		rec.Borrowed = true
		a := netip.MustParseAddr("10.0.0.7")
		w := records.IPWrite{Pool: "p", Block: blockA, ClaimRev: fence + 100, Addr: a, Record: rec, Borrowed: true}
		_, err = f.Store.WriteIPs(f.ctx, []records.IPWrite{w})
		var we *records.WriteError
		require.ErrorAs(t, err, &we)
		require.Equal(t, records.WriteError{FenceLost: true}, *we)
		// The lender's claim lapsing leaves its home: still a block to
		// borrow from (orphaned, held).
		f.Revoke(lenderLease)
		w.ClaimRev = fence
		_, err = f.Store.WriteIPs(f.ctx, []records.IPWrite{w})
		require.NoError(t, err)
		// No home: released, nothing may be written into it.
		w2 := w
		w2.Block, w2.Addr = blockB, netip.MustParseAddr("10.0.0.20")
		_, err = f.Store.WriteIPs(f.ctx, []records.IPWrite{w2})
		require.ErrorAs(t, err, &we)
		require.Equal(t, records.WriteError{Fenced: []netip.Prefix{blockB}}, *we)
		// The borrower's lease ending takes its fence: every borrowed
		// write is refused.
		f.Revoke(lease)
		w.Addr = netip.MustParseAddr("10.0.0.8")
		_, err = f.Store.WriteIPs(f.ctx, []records.IPWrite{w})
		require.ErrorAs(t, err, &we)
		require.True(t, we.FenceLost)
	}},
	{"loans/snapshot", func(t *testing.T, f *fixture) {
		revA, leaseA := f.claim(t, "n1", blockA)
		a1, a2 := netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("10.0.0.9")
		f.write(t, blockA, revA, a2, f.rec(2, "n1", records.StateAllocated), false)
		r := f.write(t, blockA, revA, a1, f.rec(1, "n1", records.StateReserved), true)
		revB, leaseB := f.claim(t, "n2", blockB)
		f.Revoke(leaseB)
		snap, err := f.Store.PoolSnapshot(f.ctx, "p")
		require.NoError(t, err)
		require.GreaterOrEqual(t, snap.Rev, revB)
		require.Len(t, snap.Blocks, 2)
		byBlock := map[netip.Prefix]records.BlockInfo{}
		for _, bi := range snap.Blocks {
			byBlock[bi.Block] = bi
		}
		require.Equal(t, leaseA, byBlock[blockA].ClaimLease)
		require.Nil(t, byBlock[blockB].Claim, "claim lapsed")
		require.Equal(t, "n2", byBlock[blockB].Home.Node, "home stays")
		require.ElementsMatch(t, []records.UsedAddr{{Addr: a1, Lease: r.Lease}, {Addr: a2}}, snap.Used[blockA])
		require.Empty(t, snap.Used[blockB])
		require.Empty(t, snap.Lent)
		empty, err := f.Store.PoolSnapshot(f.ctx, "q")
		require.NoError(t, err)
		require.Empty(t, empty.Blocks)
	}},
}
