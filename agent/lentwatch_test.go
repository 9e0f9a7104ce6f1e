package agent

import (
	"context"
	"net/netip"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/internal/testsupport/agenttest"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// resetSignal passes every call on to a handler of homes and says on
// resets when one Reset has returned.
type resetSignal struct {
	etcdstore.Handler[etcdstore.BlockHome]
	resets chan<- struct{}
}

func (r resetSignal) Reset(h []etcdstore.BlockHome) {
	r.Handler.Reset(h)
	r.resets <- struct{}{}
}

// signalledHomes is a homeSource whose handler signals its resets.
type signalledHomes struct {
	src    homeSource
	resets chan struct{}
}

func (s signalledHomes) WatchHomes(ctx context.Context, h etcdstore.Handler[etcdstore.BlockHome]) error {
	return s.src.WatchHomes(ctx, resetSignal{Handler: h, resets: s.resets})
}

func lentOf(al *nodealloc.Allocator, pool string) int {
	n := 0
	for _, u := range al.Usage() {
		if u.Pool == pool {
			n += u.Lent
		}
	}
	return n
}

// TestLentResetDropsVanishedLoans: node-2 borrows an address of node-1's
// only block; node-1's home watch sees the loan, then stops (a watch gap)
// while node-2 gives the address back. The operator disables the pool and
// node-1's last pod goes: the block can go back only once node-1 knows
// the loan is gone. The watch's next listing, which no longer holds the
// loan, must replace what node-1 knows of lent addresses, and the block
// goes back, so the pool can be deleted.
func TestLentResetDropsVanishedLoans(t *testing.T) {
	ctx := context.Background()
	e := etcdtest.Start(t)
	pool := allocator.Pool{Name: "lent", BlockSizeV4: 28, CIDRs: []netip.Prefix{netip.MustParsePrefix("10.79.0.0/28")}}
	agenttest.EnsurePool(t, e, pool)
	n1 := agenttest.Start(t, e, "node-1", agenttest.Options{Pools: []string{pool.Name}})
	n2 := agenttest.Start(t, e, "node-2", agenttest.Options{Pools: []string{pool.Name}})
	st := etcdstore.New(etcdtest.Client(t, e), etcdstore.Options{})

	n1.Allocate(t, pool.Name, 0, 1, false)
	loan := n2.Allocate(t, pool.Name, 1, 1, false)
	require.Len(t, loan, 1)
	require.True(t, loan[0].Borrowed, "the pool's only block is node-1's: node-2 borrows")

	src := signalledHomes{src: st, resets: make(chan struct{}, 1)}
	w := lentWatch{alloc: n1.Alloc}
	watch := func() (stop func()) {
		wctx, cancel := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() { defer close(done); w.run(wctx, src) }()
		<-src.resets
		stop = func() { cancel(); <-done }
		t.Cleanup(stop)
		return stop
	}

	stop := watch()
	require.Equal(t, 1, lentOf(n1.Alloc, pool.Name), "the listing shows the loan")
	stop() // the gap

	_, err := n2.Alloc.Release(ctx, agenttest.Owner(1))
	require.NoError(t, err)
	p, err := st.UpdatePool(ctx, pool.Name, func(p *allocator.Pool) error { p.Disabled = true; return nil })
	require.NoError(t, err)
	n1.Alloc.UpdatePool(p)
	_, err = n1.Alloc.Release(ctx, agenttest.Owner(0))
	require.NoError(t, err)
	require.ErrorIs(t, st.DeletePool(ctx, pool.Name), etcdstore.ErrPoolInUse, "node-1 still counts the loan")

	watch() // lists again: the loan is not there
	require.Zero(t, lentOf(n1.Alloc, pool.Name), "a listing replaces what node-1 knew of lent addresses")
	require.NoError(t, st.DeletePool(ctx, pool.Name), "the drained pool's block went back")
}
