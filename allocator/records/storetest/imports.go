package storetest

import (
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
)

// The import's writes (records.Importer): a block's claim, records, lent
// homes and marks in one step, fenced by the claimant's live lease.
var importTests = []test{
	{"ImportClaimsABlockWithItsRecordsAndMarks", testImportClaims},
	{"ImportIntoAHeldClaimIsAllOrNothing", testImportIntoClaim},
	{"ImportRefusedWhenTheNodeLeaseIsGone", testImportLeaseGone},
	{"ImportBorrowedAddressesAndFinalize", testImportBorrowed},
	{"ImportTooBigForOneTransaction", testImportTooBig},
}

// imp is an import of owners (by index) at addrs of blockA for node, on
// lease.
func (f *fixture) imp(node string, lease, claimRev int64, first int, addrs ...string) records.ImportBlock {
	b := records.ImportBlock{Pool: f.pool.Name, Block: blockA, Claimant: node, Lease: lease, ClaimRev: claimRev, PoolRev: f.pool.Rev}
	m := records.ImportMark{Source: "host-local:" + node + ":net", Node: node, Pool: f.pool.Name, Block: blockA, At: f.Now().UTC()}
	for i, a := range addrs {
		r := f.rec(first+i, node, records.StateAllocated)
		r.Imported = m.Source
		b.IPs = append(b.IPs, records.ImportedIP{Addr: addr(a), Record: r})
		m.Addrs = append(m.Addrs, addr(a))
	}
	b.Marks = []records.ImportMark{m}
	return b
}

func (f *fixture) nodeOn(node string) int64 {
	lease := f.Grant(time.Minute)
	f.NodeOn(node, lease)
	return lease
}

func testImportClaims(t *testing.T, f *fixture) {
	lease := f.nodeOn("n1")
	rev, err := f.Importer.ImportBlock(f.ctx, f.imp("n1", lease, 0, 1, "10.0.0.2", "10.0.0.3"))
	require.NoError(t, err)
	bs, err := f.Store.GetBlocks(f.ctx, f.pool.Name, []netip.Prefix{blockA})
	require.NoError(t, err)
	bi := bs[blockA]
	require.True(t, bi.Owned("n1"))
	require.Equal(t, lease, bi.ClaimLease, "the claim on the node's lease")
	require.Equal(t, rev, bi.ClaimRev)
	require.Equal(t, "n1", bi.Home.Node)
	als, err := f.Store.ListIPs(f.ctx, f.pool.Name, blockA)
	require.NoError(t, err)
	require.Len(t, als, 2)
	for _, al := range als {
		require.Equal(t, "host-local:n1:net", al.Imported)
		require.Equal(t, records.StateAllocated, al.State)
		require.Zero(t, al.Lease)
		require.Equal(t, rev, al.Rev)
	}
	ms, err := f.Importer.ListImportMarks(f.ctx)
	require.NoError(t, err)
	require.Len(t, ms, 1)
	require.Equal(t, rev, ms[0].Rev)
	require.Equal(t, []netip.Addr{addr("10.0.0.2"), addr("10.0.0.3")}, ms[0].Addrs)

	// Run again as planned before: the block is claimed now.
	_, err = f.Importer.ImportBlock(f.ctx, f.imp("n1", lease, 0, 1, "10.0.0.2", "10.0.0.3"))
	require.ErrorIs(t, err, retry.ErrConflict)
	// The lease ends: the claim goes, the records stay (orphaned).
	f.Revoke(lease)
	bs, err = f.Store.GetBlocks(f.ctx, f.pool.Name, []netip.Prefix{blockA})
	require.NoError(t, err)
	require.Nil(t, bs[blockA].Claim)
	als, err = f.Store.ListIPs(f.ctx, f.pool.Name, blockA)
	require.NoError(t, err)
	require.Len(t, als, 2)
}

func testImportIntoClaim(t *testing.T, f *fixture) {
	lease := f.nodeOn("n1")
	res, err := f.Store.Claim(f.ctx, f.pool.Name, blockA, records.Claim{Node: "n1", ClaimedAt: f.Now()}, lease)
	require.NoError(t, err)
	taken := f.write(t, blockA, res.Rev, addr("10.0.0.4"), f.rec(9, "n1", records.StateAllocated), false)
	// One address of the batch is taken: nothing is written.
	_, err = f.Importer.ImportBlock(f.ctx, f.imp("n1", lease, res.Rev, 1, "10.0.0.2", "10.0.0.4"))
	require.ErrorIs(t, err, retry.ErrConflict)
	als, err := f.Store.ListIPs(f.ctx, f.pool.Name, blockA)
	require.NoError(t, err)
	require.Len(t, als, 1)
	require.Equal(t, taken.Owner, als[0].Owner)
	ms, err := f.Importer.ListImportMarks(f.ctx)
	require.NoError(t, err)
	require.Empty(t, ms)
	// A stale claim revision: refused.
	_, err = f.Importer.ImportBlock(f.ctx, f.imp("n1", lease, res.Rev-1, 1, "10.0.0.2"))
	require.ErrorIs(t, err, retry.ErrConflict)
	_, err = f.Importer.ImportBlock(f.ctx, f.imp("n1", lease, res.Rev, 1, "10.0.0.2", "10.0.0.3"))
	require.NoError(t, err)
	als, err = f.Store.ListIPs(f.ctx, f.pool.Name, blockA)
	require.NoError(t, err)
	require.Len(t, als, 3)
}

func testImportLeaseGone(t *testing.T, f *fixture) {
	lease := f.nodeOn("n1")
	b := f.imp("n1", lease, 0, 1, "10.0.0.2")
	f.Revoke(lease)
	_, err := f.Importer.ImportBlock(f.ctx, b)
	require.ErrorIs(t, err, records.ErrLeaseLost)
	// An agent restarted: its record on a new lease, the plan's is old.
	newer := f.nodeOn("n1")
	old := f.Grant(time.Minute)
	_, err = f.Importer.ImportBlock(f.ctx, f.imp("n1", old, 0, 1, "10.0.0.2"))
	require.ErrorIs(t, err, records.ErrLeaseLost)
	als, err := f.Store.ListIPs(f.ctx, f.pool.Name, blockA)
	require.NoError(t, err)
	require.Empty(t, als)
	_, err = f.Importer.ImportBlock(f.ctx, f.imp("n1", newer, 0, 1, "10.0.0.2"))
	require.NoError(t, err)
}

func testImportBorrowed(t *testing.T, f *fixture) {
	l1, l2 := f.nodeOn("n1"), f.nodeOn("n2")
	fence, err := f.Store.FenceBorrower(f.ctx, records.Claim{Node: "n2", ClaimedAt: f.Now()}, l2)
	require.NoError(t, err)
	b := f.imp("n1", l1, 0, 1, "10.0.0.2")
	r := f.rec(2, "n2", records.StateAllocated)
	r.Imported, r.Borrowed = "whereabouts:p", true
	b.IPs = append(b.IPs, records.ImportedIP{Addr: addr("10.0.0.3"), Record: r})
	b.Marks = append(b.Marks, records.ImportMark{Source: "whereabouts:p", Node: "n2", Pool: f.pool.Name, Block: blockA, Addrs: []netip.Addr{addr("10.0.0.3")}, Borrowed: true})
	_, err = f.Importer.ImportBlock(f.ctx, b)
	require.ErrorIs(t, err, records.ErrBadRequest, "a borrowed address with no fence")
	b.Borrowers = map[string]records.BorrowFence{"n2": {Rev: fence - 1, Lease: l2}}
	_, err = f.Importer.ImportBlock(f.ctx, b)
	require.ErrorIs(t, err, retry.ErrConflict, "a fence at another revision")
	b.Borrowers["n2"] = records.BorrowFence{Rev: fence, Lease: l2}
	_, err = f.Importer.ImportBlock(f.ctx, b)
	require.NoError(t, err)
	lent, err := f.Store.ListLent(f.ctx, f.pool.Name)
	require.NoError(t, err)
	require.Equal(t, map[netip.Addr]string{addr("10.0.0.3"): "n2"}, lent)

	dropped, err := f.Importer.FinalizeImport(f.ctx, "whereabouts:p")
	require.NoError(t, err)
	require.Len(t, dropped, 1)
	require.Equal(t, "n2", dropped[0].Node)
	ms, err := f.Importer.ListImportMarks(f.ctx)
	require.NoError(t, err)
	require.Len(t, ms, 1, "the other source's mark stays")
	dropped, err = f.Importer.FinalizeImport(f.ctx, "whereabouts:p")
	require.NoError(t, err)
	require.Empty(t, dropped, "finalized again: nothing left")
	_, err = f.Importer.FinalizeImport(f.ctx, "a/b")
	require.ErrorIs(t, err, records.ErrBadRequest)
}

func testImportTooBig(t *testing.T, f *fixture) {
	lease := f.nodeOn("n1")
	b := f.imp("n1", lease, 0, 1, "10.0.0.2")
	for i := range 130 {
		m := b.Marks[0]
		m.Node = "n" + string(rune('a'+i%26)) + string(rune('a'+i/26))
		b.Marks = append(b.Marks, m)
	}
	_, err := f.Importer.ImportBlock(f.ctx, b)
	require.ErrorIs(t, err, records.ErrImportTooBig)
}
