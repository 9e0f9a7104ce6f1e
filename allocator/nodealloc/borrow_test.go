package nodealloc_test

import (
	"context"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/kvstore"
)

// A pool of one /28 block (14 usable addresses): node a claims it, node b
// can only borrow.
var onePool = allocator.Pool{Name: "one", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.82.0.0/28")}, BlockSizeV4: 28}

func lenderAndBorrower(t *testing.T, wrapB func(records.Store) records.Store) (*kvstore.Embedded, *testNode, *testNode) {
	e := startEtcd(t, onePool)
	a := startNode(t, e, "a", []string{"one"}, nodeOpts{})
	for i := range 5 {
		_, err := a.alloc.Allocate(context.Background(), nodealloc.Request{Pool: "one", Owner: owner(i)})
		require.NoError(t, err)
	}
	b := startNode(t, e, "b", []string{"one"}, nodeOpts{wrap: wrapB})
	return e, a, b
}

// holdersOf reads who holds each address of the pool in etcd.
func holdersOf(t *testing.T, cli *clientv3.Client) map[netip.Addr]records.Allocation {
	out := map[netip.Addr]records.Allocation{}
	for _, al := range storeIPs(t, cli, "one") {
		out[al.Addr] = al
	}
	return out
}

// TestBorrowUnknownOutcomeSettled: a borrowed write commits and its
// answer is lost. The borrower reads etcd before it decides anything: the
// pod gets the address that landed, once, and a retried ADD gets it again.
func TestBorrowUnknownOutcomeSettled(t *testing.T) {
	ctx := context.Background()
	var hs *hookStore
	_, a, b := lenderAndBorrower(t, func(s records.Store) records.Store { hs = newHookStore(s); return hs })
	hs.After("WriteIPs", commitThenFail(1))
	res, err := b.alloc.Allocate(ctx, nodealloc.Request{Pool: "one", Owner: owner(100)})
	require.NoError(t, err)
	require.Len(t, res.Allocations, 1)
	got := res.Allocations[0]
	require.True(t, got.Borrowed)
	again, err := b.alloc.Allocate(ctx, nodealloc.Request{Pool: "one", Owner: owner(100)})
	require.NoError(t, err)
	require.Equal(t, got.Addr, again.Allocations[0].Addr, "a retried ADD gets the address that landed")
	n := 0
	for _, al := range holdersOf(t, a.cli) {
		if al.Owner.Key() == owner(100).Key() {
			n++
		}
	}
	require.Equal(t, 1, n, "one address in etcd for the owner")
	lent, err := b.store.ListLent(ctx, "one")
	require.NoError(t, err)
	require.Equal(t, map[netip.Addr]string{got.Addr: "b"}, lent)
}

// TestBorrowFencedByBorrowerLease: the borrower's lease is revoked after
// it chose an address and before its write: the write is refused by the
// borrower's fence, and nothing is written.
func TestBorrowFencedByBorrowerLease(t *testing.T) {
	ctx := context.Background()
	var hs *hookStore
	_, a, b := lenderAndBorrower(t, func(s records.Store) records.Store { hs = newHookStore(s); return hs })
	var once sync.Once
	hs.Before("WriteIPs", func(ctx context.Context) error {
		once.Do(func() {
			_, err := b.cli.Revoke(ctx, clientv3.LeaseID(b.sess.ID()))
			require.NoError(t, err)
		})
		return nil
	})
	_, err := b.alloc.Allocate(ctx, nodealloc.Request{Pool: "one", Owner: owner(100)})
	require.ErrorIs(t, err, records.ErrLeaseLost)
	for addr, al := range holdersOf(t, a.cli) {
		require.NotEqual(t, owner(100).Key(), al.Owner.Key(), "%s written for a node whose lease was gone", addr)
	}
	lent, err := a.store.ListLent(ctx, "one")
	require.NoError(t, err)
	require.Empty(t, lent)
}

// writeHook calls onWrite with each write batch before it is sent.
type writeHook struct {
	records.Store
	onWrite func([]records.IPWrite)
}

func (w writeHook) WriteIPs(ctx context.Context, ws []records.IPWrite) (records.WriteResult, error) {
	w.onWrite(ws)
	return w.Store.WriteIPs(ctx, ws)
}

// TestBorrowRacesOwner: the block's owner has chosen an address and,
// before its write, a borrower takes that very address. The owner's
// create-if-absent fails, it learns the address is lent and hands out
// another: no address is held twice.
func TestBorrowRacesOwner(t *testing.T) {
	ctx := context.Background()
	e := startEtcd(t, onePool)
	b := startNode(t, e, "b", []string{"one"}, nodeOpts{})
	var once sync.Once
	var stolen netip.Addr
	a := startNode(t, e, "a", []string{"one"}, nodeOpts{wrap: func(s records.Store) records.Store {
		return writeHook{Store: s, onWrite: func(ws []records.IPWrite) {
			if len(ws) != 1 || ws[0].Record.Owner.Key() != owner(7).Key() {
				return
			}
			once.Do(func() {
				// b borrows exactly the address a is about to write.
				fence, err := b.store.FenceBorrower(ctx, records.Claim{Node: "b"}, b.sess.ID())
				require.NoError(t, err)
				w := ws[0]
				_, err = b.store.WriteIPs(ctx, []records.IPWrite{{Pool: w.Pool, Block: w.Block, ClaimRev: fence, Addr: w.Addr, Borrowed: true,
					Record: records.Record{Owner: owner(900), Node: "b", State: records.StateAllocated, Borrowed: true}}})
				require.NoError(t, err)
				stolen = w.Addr
			})
		}}
	}})
	for i := range 8 {
		_, err := a.alloc.Allocate(ctx, nodealloc.Request{Pool: "one", Owner: owner(i)})
		require.NoError(t, err)
	}
	require.True(t, stolen.IsValid(), "the race happened")
	mine := a.alloc.Lookup(owner(7))
	require.Len(t, mine, 1)
	require.NotEqual(t, stolen, mine[0].Addr, "the owner handed out another address")
	held := holdersOf(t, a.cli)
	require.Equal(t, owner(900).Key(), held[stolen].Owner.Key(), "the borrower keeps what it took")
	require.Len(t, held, 9)
	for _, u := range a.alloc.Usage() {
		require.Equal(t, 1, u.Lent, "the owner knows the address is lent")
	}
}

// TestBorrowRespectsCooldown: the lender released four addresses a moment
// ago, so they are cooling. A borrower, which cannot see the lender's
// memory, must still not take one while another address of the block is
// free; when nothing else is, it takes the one released longest ago.
func TestBorrowRespectsCooldown(t *testing.T) {
	ctx := context.Background()
	p := onePool // one /28 block: 14 usable addresses
	p.ReuseCooldown = allocator.DurationOf(time.Hour)
	e := startEtcd(t, p)
	a := startNode(t, e, "a", []string{"one"}, nodeOpts{})
	b := startNode(t, e, "b", []string{"one"}, nodeOpts{})
	for i := range 6 {
		_, err := a.alloc.Allocate(ctx, nodealloc.Request{Pool: "one", Owner: owner(i)})
		require.NoError(t, err)
	}
	var cooling []netip.Addr // oldest release first
	for i := range 4 {
		cooling = append(cooling, a.alloc.Lookup(owner(i))[0].Addr)
		_, err := a.alloc.Release(ctx, owner(i))
		require.NoError(t, err)
	}
	// 12 addresses are free in etcd: 4 cooling, 8 never used.
	for i := 100; i < 108; i++ {
		r, err := b.alloc.Allocate(ctx, nodealloc.Request{Pool: "one", Owner: owner(i)})
		require.NoError(t, err)
		require.True(t, r.Allocations[0].Borrowed)
		require.NotContains(t, cooling, r.Allocations[0].Addr, "borrow %d took a cooling address while others were free", i-100)
	}
	r, err := b.alloc.Allocate(ctx, nodealloc.Request{Pool: "one", Owner: owner(108)})
	require.NoError(t, err)
	require.Equal(t, cooling[0], r.Allocations[0].Addr, "the cooldown yields when nothing else is free: the oldest release first")
}
