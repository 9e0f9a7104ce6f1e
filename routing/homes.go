package routing

import (
	"context"
	"net/netip"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/internal/foundation/mirror"
	"github.com/kvipam/kvipam/internal/foundation/syncloop"
)

// homesMirror mirrors the block homes of every pool (a block, or a lent
// address as a host prefix, to its home node) from a watch of homes, and
// kicks its owner's loop on every change: the peer router and the BGP
// announcer follow homes through one.
type homesMirror struct {
	homes mirror.Map[netip.Prefix, string]
	kick  chan<- struct{}
}

func (w *homesMirror) Reset(homes []etcdstore.BlockHome) {
	w.homes.Reset(mirror.ByKey(homes, func(h etcdstore.BlockHome) (netip.Prefix, string) { return h.Block, h.Node }))
	syncloop.Kick(w.kick)
}

func (w *homesMirror) Put(h etcdstore.BlockHome) {
	w.homes.Put(h.Block, h.Node)
	syncloop.Kick(w.kick)
}

func (w *homesMirror) Delete(h etcdstore.BlockHome) {
	w.homes.Del(h.Block)
	syncloop.Kick(w.kick)
}

// HomeSource is where the BGP announcer learns the block homes
// (etcdstore.Store).
type HomeSource interface {
	WatchHomes(ctx context.Context, h etcdstore.Handler[etcdstore.BlockHome]) error
}
