package storetest

import (
	"errors"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
)

// Edges of the contract a caller may not lean on today but a second
// implementation must still get right: revisions, the order of lists,
// and what etcd's compares mean at their limits.
var edgeTests = []test{
	{"edges/revisions", func(t *testing.T, f *fixture) {
		rev := func() int64 {
			snap, err := f.Store.PoolSnapshot(f.ctx, "p")
			require.NoError(t, err)
			return snap.Rev
		}
		start := rev()
		require.GreaterOrEqual(t, start, f.pool.Rev)
		claimRev, _ := f.claim(t, "n1", blockA)
		require.Equal(t, claimRev, rev(), "a snapshot is read at the newest revision")
		// A batch is one revision; a failed write, a read and a lease
		// grant move nothing.
		res, err := f.Store.WriteIPs(f.ctx, []records.IPWrite{
			{Pool: "p", Block: blockA, ClaimRev: claimRev, Addr: addr("10.0.0.1"), Record: f.rec(1, "n1", records.StateAllocated)},
			{Pool: "p", Block: blockA, ClaimRev: claimRev, Addr: addr("10.0.0.2"), Record: f.rec(2, "n1", records.StateAllocated)},
		})
		require.NoError(t, err)
		require.Equal(t, claimRev+1, res.Rev)
		_, err = f.Store.WriteIPs(f.ctx, []records.IPWrite{{Pool: "p", Block: blockA, ClaimRev: claimRev, Addr: addr("10.0.0.1"), Record: f.rec(3, "n1", records.StateAllocated)}})
		require.Error(t, err)
		f.Grant(time.Minute)
		_, err = f.Store.ListIPs(f.ctx, "p", blockA)
		require.NoError(t, err)
		require.Equal(t, res.Rev, rev())
		// A lease's end is one revision, whatever it takes.
		r1 := f.write(t, blockA, claimRev, addr("10.0.0.3"), f.rec(3, "n1", records.StateReserved), true)
		f.write(t, blockA, claimRev, addr("10.0.0.4"), f.rec(4, "n1", records.StateReserved), true)
		before := rev()
		f.Revoke(r1.Lease)
		require.Equal(t, before+1, rev())
	}},
	{"edges/list-order", func(t *testing.T, f *fixture) {
		// Lists come in etcd's key order: block and address text, not
		// numbers ("10.0.0.128-28" before "10.0.0.16-28").
		hi := netipPrefix("10.0.0.128/28")
		revHi, _ := f.claim(t, "n1", hi)
		revB, leaseB := f.claim(t, "n2", blockB)
		f.claim(t, "n1", blockA)
		f.write(t, blockB, revB, addr("10.0.0.17"), f.rec(1, "n2", records.StateAllocated), false)
		f.Revoke(leaseB) // blockB: a home, no claim
		blocks, err := f.Store.ListBlocks(f.ctx, "p")
		require.NoError(t, err)
		var order []netip.Prefix
		for _, bi := range blocks {
			order = append(order, bi.Block)
		}
		require.Equal(t, []netip.Prefix{blockA, hi, blockB}, order, "claims by name, then blocks with only a home")
		for _, a := range []string{"10.0.0.140", "10.0.0.129", "10.0.0.131"} {
			f.write(t, hi, revHi, addr(a), f.rec(2, "n1", records.StateAllocated), false)
		}
		list, err := f.Store.ListIPs(f.ctx, "p", hi)
		require.NoError(t, err)
		var addrs []string
		for _, al := range list {
			addrs = append(addrs, al.Addr.String())
		}
		require.Equal(t, []string{"10.0.0.129", "10.0.0.131", "10.0.0.140"}, addrs)
		snap, err := f.Store.PoolSnapshot(f.ctx, "p")
		require.NoError(t, err)
		require.Equal(t, []records.UsedAddr{{Addr: addr("10.0.0.129")}, {Addr: addr("10.0.0.131")}, {Addr: addr("10.0.0.140")}}, snap.Used[hi])
		for _, id := range []string{"ns/b", "ns/a-1", "ns/a"} {
			_, err := f.Store.WriteBound(f.ctx, records.Binding{Pool: "p", Identity: id, Owner: owner(1)}, nil)
			require.NoError(t, err)
		}
		bs, err := f.Store.ListBindings(f.ctx, "p")
		require.NoError(t, err)
		var ids []string
		for _, b := range bs {
			ids = append(ids, b.Identity)
		}
		require.Equal(t, []string{"ns/a", "ns/a-1", "ns/b"}, ids)
	}},
	{"edges/one-address-twice", func(t *testing.T, f *fixture) {
		// A batch that writes one address twice is refused whole: not a
		// lost race (a retry would fail the same), nothing written.
		rev, _ := f.claim(t, "n1", blockA)
		w := records.IPWrite{Pool: "p", Block: blockA, ClaimRev: rev, Addr: addr("10.0.0.1"), Record: f.rec(1, "n1", records.StateAllocated)}
		_, err := f.Store.WriteIPs(f.ctx, []records.IPWrite{w, w})
		require.Error(t, err)
		require.False(t, errors.Is(err, retry.ErrConflict) || errors.Is(err, retry.ErrUnavailable), "%v", err)
		f.absent(t, blockA, w.Addr)
	}},
	{"edges/fence-compared-once", func(t *testing.T, f *fixture) {
		// A block's claim is compared once per batch, at the revision of
		// the first write into it: a second write's ClaimRev is not
		// checked by the write (only by its explanation).
		rev, _ := f.claim(t, "n1", blockA)
		_, err := f.Store.WriteIPs(f.ctx, []records.IPWrite{
			{Pool: "p", Block: blockA, ClaimRev: rev, Addr: addr("10.0.0.1"), Record: f.rec(1, "n1", records.StateAllocated)},
			{Pool: "p", Block: blockA, ClaimRev: rev + 7, Addr: addr("10.0.0.2"), Record: f.rec(2, "n1", records.StateAllocated)},
		})
		require.NoError(t, err)
		f.get(t, blockA, addr("10.0.0.2"), 0)
		// The other way round, the batch is fenced.
		_, err = f.Store.WriteIPs(f.ctx, []records.IPWrite{
			{Pool: "p", Block: blockA, ClaimRev: rev + 7, Addr: addr("10.0.0.3"), Record: f.rec(3, "n1", records.StateAllocated)},
			{Pool: "p", Block: blockA, ClaimRev: rev, Addr: addr("10.0.0.4"), Record: f.rec(4, "n1", records.StateAllocated)},
		})
		var we *records.WriteError
		require.ErrorAs(t, err, &we)
		require.Equal(t, []netip.Prefix{blockA}, we.Fenced)
	}},
	{"edges/unclaim-revision-zero", func(t *testing.T, f *fixture) {
		// Revision 0 compares "absent": an orphan's empty block, whose
		// claim lapsed, loses its home to Unclaim(0).
		rev, lease := f.claim(t, "n1", blockA)
		al := f.write(t, blockA, rev, addr("10.0.0.1"), f.rec(1, "n1", records.StateAllocated), false)
		f.Revoke(lease)
		require.NoError(t, f.Store.DeleteIP(f.ctx, al))
		_, ok := f.block(t, blockA)
		require.True(t, ok, "the home outlives the claim")
		require.NoError(t, f.Store.Unclaim(f.ctx, "p", blockA, 0))
		_, ok = f.block(t, blockA)
		require.False(t, ok)
	}},
	{"edges/claim-reservation-lease-gone", func(t *testing.T, f *fixture) {
		// A claim whose first reservation's lease is gone is a lost race
		// (retried on a new lease), not a lost node lease.
		rev, _ := f.claim(t, "n1", blockA)
		r := f.write(t, blockA, rev, addr("10.0.0.1"), f.rec(1, "n1", records.StateReserved), true)
		f.Revoke(r.Lease)
		lease := f.Grant(time.Minute)
		first := records.IPWrite{Pool: "p", Block: blockB, Addr: addr("10.0.0.17"), Record: f.rec(2, "n1", records.StateReserved), Reserve: true}
		_, err := f.Store.Claim(f.ctx, "p", blockB, records.Claim{Node: "n1", First: &first}, lease)
		require.ErrorIs(t, err, retry.ErrConflict)
		require.False(t, errors.Is(err, records.ErrLeaseLost))
		_, ok := f.block(t, blockB)
		require.False(t, ok)
		res, err := f.Store.Claim(f.ctx, "p", blockB, records.Claim{Node: "n1", First: &first}, lease)
		require.NoError(t, err)
		require.NotEqual(t, r.Lease, f.get(t, blockB, first.Addr, res.Rev).Lease)
	}},
	{"edges/keep-borrowed", func(t *testing.T, f *fixture) {
		// A kept borrowed address keeps its home on the window's lease,
		// and the lender's own takeover of it ends the loan.
		revA, _ := f.claim(t, "lender", blockA)
		a := addr("10.0.0.5")
		f.keepBorrowed(t, a)
		kept := f.get(t, blockA, a, 0)
		require.True(t, kept.Borrowed)
		snap, err := f.Store.PoolSnapshot(f.ctx, "p")
		require.NoError(t, err)
		require.Equal(t, map[netip.Addr]string{a: "n1"}, snap.Lent)
		// Taken over in the lender's own block: no longer lent.
		kb, _, err := f.Store.GetBinding(f.ctx, "p", identity)
		require.NoError(t, err)
		next := kb
		next.Owner, next.Node = owner(2), "lender"
		rec2 := f.rec(2, "lender", records.StateAllocated)
		rec2.Identity = identity
		_, err = f.Store.WriteBound(f.ctx, next, []records.IPWrite{{Pool: "p", Block: blockA, ClaimRev: revA, Addr: a, Record: rec2, PrevRev: kept.Rev}})
		require.NoError(t, err)
		lent, err := f.Store.ListLent(f.ctx, "p")
		require.NoError(t, err)
		require.Empty(t, lent)
	}},
	{"edges/keep-lapse-takes-lent", func(t *testing.T, f *fixture) {
		f.claim(t, "lender", blockA)
		a := addr("10.0.0.6")
		f.keepBorrowed(t, a)
		kb, _, err := f.Store.GetBinding(f.ctx, "p", identity)
		require.NoError(t, err)
		f.Revoke(kb.Lease)
		f.absent(t, blockA, a)
		lent, err := f.Store.ListLent(f.ctx, "p")
		require.NoError(t, err)
		require.Empty(t, lent)
	}},
}

// keepBorrowed has node n1 borrow a in blockA (another node's) for the
// sticky identity, bound, and keep it after its pod's DEL.
func (f *fixture) keepBorrowed(t *testing.T, a netip.Addr) {
	t.Helper()
	fence, err := f.Store.FenceBorrower(f.ctx, records.Claim{Node: "n1"}, f.Grant(time.Minute))
	require.NoError(t, err)
	rec := f.rec(1, "n1", records.StateAllocated)
	rec.Borrowed, rec.Identity = true, identity
	bd := records.Binding{Pool: "p", Identity: identity, Addrs: []netip.Addr{a}, Owner: owner(1), Node: "n1", WindowSeconds: 30}
	res, err := f.Store.WriteBound(f.ctx, bd, []records.IPWrite{{Pool: "p", Block: blockA, ClaimRev: fence, Addr: a, Record: rec, Borrowed: true}})
	require.NoError(t, err)
	bd.Rev = res.Rev
	_, err = f.Store.Keep(f.ctx, bd, []records.Allocation{f.get(t, blockA, a, res.Rev)})
	require.NoError(t, err)
}

// txnSizeTests: etcd refuses a transaction of more than --max-txn-ops
// (128) compares, or operations in a branch, whole.
var txnSizeTests = []test{
	{"edges/txn-size", func(t *testing.T, f *fixture) {
		_, err := f.Store.EnsurePool(f.ctx, allocator.Pool{Name: "big", CIDRs: []netip.Prefix{netipPrefix("10.9.0.0/16")}, BlockSizeV4: 24})
		require.NoError(t, err)
		big := netipPrefix("10.9.0.0/24")
		lease := f.Grant(time.Minute)
		res, err := f.Store.Claim(f.ctx, "big", big, records.Claim{Node: "n1"}, lease)
		require.NoError(t, err)
		batch := func(from, n int, fence int64, borrowed bool) []records.IPWrite {
			var ws []records.IPWrite
			for i := range n {
				r := f.rec(from+i, "n1", records.StateAllocated)
				r.Borrowed = borrowed
				ws = append(ws, records.IPWrite{Pool: "big", Block: big, ClaimRev: fence, Addr: netip.AddrFrom4([4]byte{10, 9, 0, byte(from + i)}), Record: r, Borrowed: borrowed})
			}
			return ws
		}
		count := func() int {
			list, err := f.Store.ListIPs(f.ctx, "big", big)
			require.NoError(t, err)
			return len(list)
		}
		// 128 writes: 129 compares with the claim's.
		_, err = f.Store.WriteIPs(f.ctx, batch(1, 128, res.Rev, false))
		require.Error(t, err)
		require.False(t, errors.Is(err, retry.ErrConflict) || errors.Is(err, retry.ErrUnavailable), "%v", err)
		require.Zero(t, count())
		_, err = f.Store.WriteIPs(f.ctx, batch(1, 127, res.Rev, false))
		require.NoError(t, err)
		require.Equal(t, 127, count())
		// Borrowed: two puts a write (the address and its home).
		f2, err := f.Store.FenceBorrower(f.ctx, records.Claim{Node: "n2"}, lease)
		require.NoError(t, err)
		big2 := netipPrefix("10.9.1.0/24")
		_, err = f.Store.Claim(f.ctx, "big", big2, records.Claim{Node: "lender"}, lease)
		require.NoError(t, err)
		ws := batch(0, 65, f2, true)
		for i := range ws {
			ws[i].Block, ws[i].Addr = big2, netip.AddrFrom4([4]byte{10, 9, 1, byte(i)})
			ws[i].Record.Node = "n2"
		}
		_, err = f.Store.WriteIPs(f.ctx, ws)
		require.Error(t, err)
		require.False(t, errors.Is(err, retry.ErrConflict) || errors.Is(err, retry.ErrUnavailable), "%v", err)
		_, err = f.Store.WriteIPs(f.ctx, ws[:64])
		require.NoError(t, err)
		lent, err := f.Store.ListLent(f.ctx, "big")
		require.NoError(t, err)
		require.Len(t, lent, 64)
	}},
}

// moreEdgeTests: lease errors of a claim with a first address, a kept
// record's release, and reads larger than one etcd transaction.
var moreEdgeTests = []test{
	{"edges/claim-first-node-lease-gone", func(t *testing.T, f *fixture) {
		// The reservation lease lives, the node's does not: a lost lease.
		rev, _ := f.claim(t, "n1", blockA)
		f.write(t, blockA, rev, addr("10.0.0.1"), f.rec(1, "n1", records.StateReserved), true)
		lease := f.Grant(time.Minute)
		f.Revoke(lease)
		first := records.IPWrite{Pool: "p", Block: blockB, Addr: addr("10.0.0.17"), Record: f.rec(2, "n1", records.StateReserved), Reserve: true}
		_, err := f.Store.Claim(f.ctx, "p", blockB, records.Claim{Node: "n1", First: &first}, lease)
		require.ErrorIs(t, err, records.ErrLeaseLost)
		require.False(t, errors.Is(err, retry.ErrConflict))
		_, ok := f.block(t, blockB)
		require.False(t, ok)
		// The reservation lease is still good for the next write.
		f.write(t, blockA, rev, addr("10.0.0.2"), f.rec(3, "n1", records.StateReserved), true)
	}},
	{"edges/release-kept", func(t *testing.T, f *fixture) {
		// Releasing a kept record leaves the identity's binding: it is
		// the identity's, not a pod's.
		rev, _ := f.claim(t, "n1", blockA)
		a := addr("10.0.0.1")
		bd, al := f.bind(t, 1, "n1", blockA, rev, a)
		_, err := f.Store.Keep(f.ctx, bd, []records.Allocation{al})
		require.NoError(t, err)
		kept := f.get(t, blockA, a, 0)
		require.NoError(t, f.Store.DeleteIP(f.ctx, kept))
		f.absent(t, blockA, a)
		kb, ok, err := f.Store.GetBinding(f.ctx, "p", identity)
		require.NoError(t, err)
		require.True(t, ok)
		require.Equal(t, kept.Rev, kb.Rev)
	}},
	{"edges/reclaim-without-home", func(t *testing.T, f *fixture) {
		_, err := f.Store.Reclaim(f.ctx, "p", records.BlockInfo{Block: blockA}, records.Claim{Node: "n1"}, f.Grant(time.Minute))
		require.ErrorIs(t, err, records.ErrNotOwned)
		_, ok := f.block(t, blockA)
		require.False(t, ok)
	}},
	{"edges/large-reads", func(t *testing.T, f *fixture) {
		// Reads of more keys than one etcd transaction holds.
		_, err := f.Store.EnsurePool(f.ctx, allocator.Pool{Name: "big", CIDRs: []netip.Prefix{netipPrefix("10.9.0.0/16")}, BlockSizeV4: 24})
		require.NoError(t, err)
		lease := f.Grant(time.Minute)
		var blocks []netip.Prefix
		var refs []records.IPRef
		for i := range 3 {
			b := netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 9, byte(i), 0}), 24)
			blocks = append(blocks, b)
			res, err := f.Store.Claim(f.ctx, "big", b, records.Claim{Node: "n1"}, lease)
			require.NoError(t, err)
			var ws []records.IPWrite
			for j := range 100 {
				a := netip.AddrFrom4([4]byte{10, 9, byte(i), byte(j)})
				ws = append(ws, records.IPWrite{Pool: "big", Block: b, ClaimRev: res.Rev, Addr: a, Record: f.rec(j, "n1", records.StateAllocated)})
				refs = append(refs, records.IPRef{Pool: "big", Block: b, Addr: a})
			}
			_, err = f.Store.WriteIPs(f.ctx, ws)
			require.NoError(t, err)
		}
		for i := range 100 {
			blocks = append(blocks, netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 9, byte(10 + i), 0}), 24))
		}
		got, err := f.Store.GetIPs(f.ctx, refs)
		require.NoError(t, err)
		require.Len(t, got, 300)
		bis, err := f.Store.GetBlocks(f.ctx, "big", blocks)
		require.NoError(t, err)
		require.Len(t, bis, 3)
		snap, err := f.Store.PoolSnapshot(f.ctx, "big")
		require.NoError(t, err)
		require.Len(t, snap.Used, 3)
		require.Len(t, snap.Used[blocks[2]], 100)
	}},
}

// zeroTests pin what revision 0 means in a fence today: etcd's compare on
// a mod revision of 0 is "absent", so a write with ClaimRev 0 lands in an
// unclaimed block (an orphan's too), and a borrowed write with fence 0
// lands for a node with no borrow fence. Nothing in the node allocator
// sends 0; a store that refused it (ErrBadRequest, as DeleteIP refuses
// revision 0) would change this test, in both stores at once.
var zeroTests = []test{
	{"edges/revision-zero-means-absent", func(t *testing.T, f *fixture) {
		rev, lease := f.claim(t, "n1", blockA)
		f.write(t, blockA, rev, addr("10.0.0.1"), f.rec(1, "n1", records.StateAllocated), false)
		f.Revoke(lease) // blockA: orphaned, n1's
		res, err := f.Store.WriteIPs(f.ctx, []records.IPWrite{{Pool: "p", Block: blockA, Addr: addr("10.0.0.2"), Record: f.rec(2, "n2", records.StateAllocated)}})
		require.NoError(t, err, "ClaimRev 0 compares no claim")
		f.get(t, blockA, addr("10.0.0.2"), res.Rev)
		f.claim(t, "n3", blockB)
		_, err = f.Store.WriteIPs(f.ctx, []records.IPWrite{{Pool: "p", Block: blockB, Addr: addr("10.0.0.17"), Record: f.rec(3, "n2", records.StateAllocated)}})
		var we *records.WriteError
		require.ErrorAs(t, err, &we, "a claimed block fences a write of revision 0")
		rec := f.rec(4, "n2", records.StateAllocated)
		rec.Borrowed = true
		_, err = f.Store.WriteIPs(f.ctx, []records.IPWrite{{Pool: "p", Block: blockB, Addr: addr("10.0.0.18"), Record: rec, Borrowed: true}})
		require.NoError(t, err, "fence 0 compares no borrow fence")
	}},
}
