package agent

import (
	"context"
	"net/netip"

	"github.com/kvipam/kvipam/allocator/etcdstore"
)

// lentWatch tells the allocator which addresses of this node's blocks
// other nodes borrowed and gave back, as their homes come and go in etcd,
// so that the node's books (kvipam_pool_lent_addresses, its free count)
// are right without waiting for a failed write to teach it.
type lentWatch struct {
	alloc interface {
		NoteLent(pool string, addr netip.Addr, node string, present bool)
	}
}

// homeSource is where homes come from (etcdstore.Store).
type homeSource interface {
	WatchHomes(ctx context.Context, h etcdstore.HomesHandler) error
}

func (w lentWatch) run(ctx context.Context, src homeSource) { _ = src.WatchHomes(ctx, w) }

func (w lentWatch) ResetHomes(homes []etcdstore.BlockHome) {
	for _, h := range homes {
		w.PutHome(h)
	}
}

func (w lentWatch) PutHome(h etcdstore.BlockHome) {
	if h.Lent {
		w.alloc.NoteLent(h.Pool, h.Block.Addr(), h.Node, true)
	}
}

func (w lentWatch) DeleteHome(h etcdstore.BlockHome) {
	if h.Lent {
		w.alloc.NoteLent(h.Pool, h.Block.Addr(), "", false)
	}
}
