package agent

import (
	"context"
	"net/netip"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/nodealloc"
)

// lentWatch tells the allocator which addresses of this node's blocks
// other nodes borrowed and gave back, as their homes come and go in etcd,
// so that the node's books (kvipam_pool_lent_addresses, its free count)
// are right without waiting for a failed write to teach it. A loan given
// back may leave a disabled pool's block (or a draining cidr's) empty: it
// goes back at once, so that the drained pool can be deleted (the cidr
// removed).
type lentWatch struct {
	alloc interface {
		NoteLent(pool string, addr netip.Addr, node string, rev int64, present bool)
		ResetLent(lent map[string]map[netip.Addr]nodealloc.Loan) []string
		Pool(name string) (allocator.Pool, bool)
		Serves(pool string) bool
		GiveBackEmpty(ctx context.Context, pool string) int
	}
	ctx context.Context // the watch's, for giving blocks back
}

// homeSource is where homes come from (etcdstore.Store).
type homeSource interface {
	WatchHomes(ctx context.Context, h etcdstore.Handler[etcdstore.BlockHome]) error
}

func (w lentWatch) run(ctx context.Context, src homeSource) {
	w.ctx = ctx
	_ = src.WatchHomes(ctx, w)
}

// Reset replaces everything the node knows of lent addresses: a
// loan given back during a watch gap is in no event, only missing here.
func (w lentWatch) Reset(homes []etcdstore.BlockHome) {
	lent := map[string]map[netip.Addr]nodealloc.Loan{}
	for _, h := range homes {
		if !h.Lent {
			continue
		}
		if lent[h.Pool] == nil {
			lent[h.Pool] = map[netip.Addr]nodealloc.Loan{}
		}
		lent[h.Pool][h.Block.Addr()] = nodealloc.Loan{Node: h.Node, Rev: h.Rev}
	}
	for _, pool := range w.alloc.ResetLent(lent) {
		w.giveBack(pool)
	}
}

func (w lentWatch) Put(h etcdstore.BlockHome) {
	if h.Lent {
		w.alloc.NoteLent(h.Pool, h.Block.Addr(), h.Node, h.Rev, true)
	}
}

func (w lentWatch) Delete(h etcdstore.BlockHome) {
	if h.Lent {
		w.alloc.NoteLent(h.Pool, h.Block.Addr(), "", 0, false)
		w.giveBack(h.Pool)
	}
}

// giveBack gives the empty blocks of a pool the node does not serve (a
// disabled one, one whose selector does not choose the node), and of a
// pool's draining cidrs, back; a pool in service with none draining
// keeps them (and the watch does not wait for the allocator's lock).
func (w lentWatch) giveBack(pool string) {
	if p, ok := w.alloc.Pool(pool); ok && (!w.alloc.Serves(pool) || len(p.Draining) > 0) && w.ctx != nil {
		w.alloc.GiveBackEmpty(w.ctx, pool)
	}
}
