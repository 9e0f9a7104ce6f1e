package agent

import (
	"context"

	"github.com/hashicorp/go-hclog"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
)

// poolWatch hands every pool spec in etcd, new or changed (kvipamctl
// pool create, reserve, disable, add-cidr, select...), to the allocator,
// so agents follow etcd without a restart. An invalid spec goes too: the
// allocator refuses it with its reason (a pool overlapping a special
// range, written before such pools were refused). A deleted pool is
// served as disabled: nothing new is handed out, releases go on.
type poolWatch struct {
	alloc poolUpdater
	log   hclog.Logger
	ctx   context.Context // the watch's, for giving blocks back
}

// poolUpdater is the allocator's side of it.
type poolUpdater interface {
	UpdatePool(p allocator.Pool)
	Pool(name string) (allocator.Pool, bool)
	Pools() []allocator.Pool
	GiveBackEmpty(ctx context.Context, pool string) int
}

// poolSource is where pool specs come from (etcdstore.Store).
type poolSource interface {
	WatchPools(ctx context.Context, h etcdstore.Handler[allocator.Pool]) error
}

func (w poolWatch) run(ctx context.Context, src poolSource) {
	w.ctx = ctx
	_ = src.WatchPools(ctx, w)
}

// Reset applies every pool listed, and treats a pool the allocator knows
// that the listing lacks as deleted while no one watched.
func (w poolWatch) Reset(pools []allocator.Pool) {
	listed := map[string]bool{}
	for _, p := range pools {
		listed[p.Name] = true
		w.Put(p)
	}
	for _, p := range w.alloc.Pools() {
		if !listed[p.Name] && !p.Disabled {
			w.Delete(allocator.Pool{Name: p.Name})
		}
	}
}

// Put applies a pool's new spec (a pool created in etcd is served from
// now on); a disabled pool, one whose node selector no longer chooses
// this node, and a pool's draining cidrs get their empty blocks back at
// once, so that it can be
// deleted when its pods are gone and other nodes can claim them.
func (w poolWatch) Put(p allocator.Pool) {
	w.alloc.UpdatePool(p)
	if w.ctx != nil {
		if n := w.alloc.GiveBackEmpty(w.ctx, p.Name); n > 0 {
			w.log.Info("pool disabled, refused, not for this node, or draining cidrs: gave empty blocks back", "pool", p.Name, "blocks", n,
				"node_selector", p.NodeSelector, "draining", p.Draining)
		}
	}
}

func (w poolWatch) Delete(gone allocator.Pool) {
	name := gone.Name
	p, ok := w.alloc.Pool(name)
	if !ok {
		return
	}
	w.log.Warn("a served pool was deleted; it hands out nothing new", "pool", name)
	p.Disabled = true
	w.alloc.UpdatePool(p)
}
