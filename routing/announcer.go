package routing

import (
	"context"
	"net/netip"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/syncloop"
	"github.com/kvipam/kvipam/kvstore"
	"github.com/kvipam/kvipam/routing/bgp"
)

// Speaker is what routing bgp needs of a BGP speaker (bgp.Speaker):
// make the announced routes equal a set.
type Speaker interface {
	Sync(ctx context.Context, want []bgp.Route) error
}

// Lease is the node's lease as the announcer follows it (the agent's
// lease keeper): the lease the node's blocks are held on now, nil while
// none is, and a channel closed when that changes.
type Lease interface {
	Current() (*kvstore.Session, <-chan struct{})
}

// Holdings is what the node holds (nodealloc.Allocator): its blocks, per
// pool and family, and its allocations, the borrowed ones among them;
// nothing sure until Restore has re-claimed them on the current lease. Its
// calls may wait on etcd (a restore holds the allocator's lock), so the
// announcer reads it off its loop.
type Holdings interface {
	Restored() bool
	Usage() []nodealloc.Usage
	Allocations() []records.Allocation
	// HeldChanged is closed when the node learns addresses a
	// cut-over moved to it or away: the cut-over's lent home may have
	// come before them, and found them missing.
	HeldChanged() <-chan struct{}
}

// BGPSources are what the announcer follows: the block homes in etcd,
// the node's lease, and what the node holds on it.
type BGPSources struct {
	Homes HomeSource
	Lease Lease
	Held  Holdings
}

// Announcer has the speaker announce what this node holds, each block
// it claimed (one prefix) and each address it borrowed (a /32 or /128)
// with this node's address of the family as next hop, while it can prove
// that it holds them, and nothing else (design invariant 10).
//
// A prefix is announced while three sources agree: the block homes in
// etcd (a watch; a home carries no lease) name this node; the allocator
// holds it on the current lease (after a lost lease, what Restore
// re-claimed on the new one: a block another node took meanwhile is not
// announced again, however late the watch of homes catches up); and etcd
// keeps that lease, provably, for at least the horizon more
// (kvstore.Session.HeldUntil). The horizon is the graceful-restart time,
// how long routers keep the routes of an agent that is gone: so they drop
// them before etcd can expire its lease and give its blocks to another
// node. A node cut off from etcd withdraws everything, over its live
// sessions, when HeldUntil comes within the horizon, and announces again
// once a new lease is granted and its blocks re-claimed on it.
//
// It announces nothing, and the speaker peers with no router, until the
// homes are listed and a proven lease holds the re-claimed blocks: a
// restarted agent's first set is complete, so the routers, which kept its
// routes (graceful restart), see nothing change.
type Announcer struct {
	node     string
	src      BGPSources
	speaker  Speaker
	horizon  time.Duration
	nextHop4 netip.Addr
	nextHop6 netip.Addr
	log      hclog.Logger

	homes   homesMirror   // block or lent address -> home node
	refresh chan struct{} // wakes the reader of holdings
	held    heldSnapshot
	loop    syncloop.Loop
	// The loop's own: whether the speaker has had a set (and peered),
	// and whether the last pass found no proven lease.
	peered, fenced bool
}

// heldSnapshot is the last read of what the node holds, with the lease
// it was read on. It is safe for concurrent use.
type heldSnapshot struct {
	mu       sync.Mutex
	sess     *kvstore.Session
	prefixes map[netip.Prefix]bool
}

func (h *heldSnapshot) set(sess *kvstore.Session, prefixes map[netip.Prefix]bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.sess, h.prefixes = sess, prefixes
}

func (h *heldSnapshot) get() (*kvstore.Session, map[netip.Prefix]bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.sess, h.prefixes
}

// NewAnnouncer is node's announcer into speaker: the first of addrs of
// each family is the next hop of that family's prefixes, and horizon is
// the speaker's graceful-restart time.
func NewAnnouncer(node string, addrs []string, src BGPSources, speaker Speaker, horizon time.Duration, log hclog.Logger) *Announcer {
	a := &Announcer{node: node, src: src, speaker: speaker, horizon: horizon, log: log,
		refresh: make(chan struct{}, 1), loop: syncloop.New("bgp announcements", log)}
	a.homes.kick = a.refresh
	for _, s := range addrs {
		ad, err := netip.ParseAddr(s)
		if err != nil {
			continue
		}
		switch {
		case ad.Is4() && !a.nextHop4.IsValid():
			a.nextHop4 = ad
		case ad.Is6() && !a.nextHop6.IsValid():
			a.nextHop6 = ad
		}
	}
	return a
}

// Run announces until ctx ends. Its owner (the agent) waits for it.
func (a *Announcer) Run(ctx context.Context) {
	var wg sync.WaitGroup
	wg.Go(func() { _ = a.src.Homes.WatchHomes(ctx, &a.homes) })
	wg.Go(func() { a.followLease(ctx) })
	wg.Go(func() { a.readHoldings(ctx) })
	wg.Go(func() { a.followHoldings(ctx) })
	defer wg.Wait()
	a.loop.Run(ctx, func() (bool, error) {
		want, known := a.desired()
		if !known {
			return false, nil
		}
		a.peered = true
		return true, a.speaker.Sync(ctx, want)
	})
}

// followLease wakes the loop, and the reader of holdings, whenever what
// the lease proves may have changed: the keeper holds another lease, a
// keepalive moved HeldUntil, the lease was lost, or HeldUntil came within
// the horizon. It never waits on etcd or the allocator, so a withdrawal
// is never late for want of them.
func (a *Announcer) followLease(ctx context.Context) {
	horizon := time.NewTimer(time.Hour)
	defer horizon.Stop()
	for {
		sess, changed := a.src.Lease.Current()
		var moved <-chan struct{}
		horizon.Stop()
		if sess != nil {
			var until time.Time
			until, moved = sess.HeldUntil()
			if d := time.Until(until) - a.horizon; d > 0 {
				horizon.Reset(d)
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-changed:
		case <-moved: // closed on loss too
		case <-horizon.C:
		}
		syncloop.Kick(a.refresh)
		a.loop.Changed()
	}
}

// followHoldings wakes the reader of holdings whenever the node learns
// addresses a cut-over moved: a live migration's, made by another node
// or an operator, whose lent home the watch of homes may have brought
// before the allocator had them.
func (a *Announcer) followHoldings(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-a.src.Held.HeldChanged():
		}
		syncloop.Kick(a.refresh)
	}
}

// readHoldings reads what the node holds whenever homes or the lease may
// have changed, and wakes the loop with it.
func (a *Announcer) readHoldings(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-a.refresh:
		}
		sess, prefixes := a.readHeld()
		a.held.set(sess, prefixes)
		a.loop.Changed()
	}
}

// readHeld is every block and borrowed address the node holds on its
// current lease, and that lease; nil while none is held or the blocks
// are not re-claimed on it yet.
func (a *Announcer) readHeld() (*kvstore.Session, map[netip.Prefix]bool) {
	sess, _ := a.src.Lease.Current()
	if sess == nil || !a.src.Held.Restored() {
		return nil, nil
	}
	out := map[netip.Prefix]bool{}
	for _, u := range a.src.Held.Usage() {
		for _, b := range u.Blocks {
			out[b] = true
		}
	}
	for _, al := range a.src.Held.Allocations() {
		if al.Borrowed {
			out[netip.PrefixFrom(al.Addr, al.Addr.BitLen())] = true
		}
	}
	if again, _ := a.src.Lease.Current(); again != sess {
		return nil, nil // another lease meanwhile: followLease asks again
	}
	return sess, out
}

// proven is what the node holds on a lease etcd keeps for at least the
// horizon more; false while it holds none such.
func (a *Announcer) proven() (map[netip.Prefix]bool, bool) {
	sess, _ := a.src.Lease.Current()
	if sess == nil {
		return nil, false
	}
	until, _ := sess.HeldUntil()
	readOn, held := a.held.get()
	if readOn != sess || time.Until(until) <= a.horizon {
		return nil, false
	}
	return held, true
}

// desired is this node's homes that it holds on a proven lease, with
// their next hops: none while the lease is not proven. known is false
// until the homes are listed and, before the speaker's first set, while
// the lease is not proven.
func (a *Announcer) desired() (routes []bgp.Route, known bool) {
	homes, listed := a.homes.homes.Snapshot()
	held, proven := a.proven()
	if !listed || (!proven && !a.peered) {
		return nil, false
	}
	if proven == a.fenced {
		a.fenced = !proven
		if a.fenced {
			a.log.Warn("bgp announcements withdrawn: the node lease is not proven for the graceful-restart time", "restart_time", a.horizon)
		} else if a.peered {
			a.log.Info("node lease proven again: announcing what the node holds on it")
		}
	}
	for p, node := range homes {
		if node != a.node || !held[p] {
			continue
		}
		nh := a.nextHop6
		if p.Addr().Is4() {
			nh = a.nextHop4
		}
		routes = append(routes, bgp.Route{Prefix: p, NextHop: nh})
	}
	return routes, true
}
