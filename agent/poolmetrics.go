package agent

import (
	"context"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
)

// Pool capacity as Prometheus series. Two kinds: a node's contribution,
// which sums across agents (allocated, borrowed, free in its blocks), and
// the pool's own figures, the same on every agent (size, reserved ranges,
// blocks by state), which aggregate with max. A pool family's fullness is
// then one expression across agents:
//
//	sum by (pool, family) (kvipam_pool_allocated_addresses)
//	  / on (pool, family) max by (pool, family) (kvipam_pool_size_addresses - kvipam_pool_reserved_addresses)
//
// deploy/prometheus has the alert rules built on them.

var (
	pf            = []string{"pool", "family"}
	descSize      = prometheus.NewDesc("kvipam_pool_size_addresses", "Addresses the pool can hand out (the same on every agent).", pf, nil)
	descResRanges = prometheus.NewDesc("kvipam_pool_reserved_addresses", "Addresses of the pool in reserved ranges, never handed out automatically (the same on every agent).", pf, nil)
	descAllocated = prometheus.NewDesc("kvipam_pool_allocated_addresses", "Addresses this node holds in the pool, reservations of unfinished ADDs and borrowed ones included.", pf, nil)
	descBorrowed  = prometheus.NewDesc("kvipam_pool_borrowed_addresses", "Addresses this node holds in other nodes' blocks.", pf, nil)
	descLent      = prometheus.NewDesc("kvipam_pool_lent_addresses", "Addresses of this node's blocks that other nodes hold.", pf, nil)
	descPending   = prometheus.NewDesc("kvipam_pool_pending_reservations", "Reservations of ADDs that have not finished; they lapse unless confirmed.", pf, nil)
	descNodeFree  = prometheus.NewDesc("kvipam_node_free_addresses", "Free addresses in this node's blocks.", pf, nil)
	descOwned     = prometheus.NewDesc("kvipam_blocks_owned", "Blocks this node holds a claim on.", pf, nil)
	descSticky    = prometheus.NewDesc("kvipam_sticky_addresses", "Addresses this node's pods hold for sticky identities (kvipam.io/sticky).", pf, nil)
	descIDs       = prometheus.NewDesc("kvipam_sticky_identities", "Sticky identities whose addresses this node's pods hold (bindings held).", pf, nil)
	descKept      = prometheus.NewDesc("kvipam_kept_addresses", "Addresses of this node's blocks kept for a sticky identity between its pods.", pf, nil)
	descBlocks    = prometheus.NewDesc("kvipam_pool_blocks", "The pool's blocks by state: claimed, orphaned (a gone node's, until kvipamctl node remove) or free (the same on every agent).",
		[]string{"pool", "family", "state"}, nil)
	descDisabled = prometheus.NewDesc("kvipam_pool_disabled", "1 when the pool is disabled: it hands out nothing new.", []string{"pool"}, nil)
	descLeaks    = prometheus.NewDesc("kvipam_leak_candidates", "Addresses this node holds whose owner has no endpoint here, past the GC grace period.", []string{"pool"}, nil)
)

// poolCollector reads the allocator's books and the pool's blocks at
// scrape time, so the series never drift from them.
type poolCollector struct {
	usage  interface{ Usage() []nodealloc.Usage }
	blocks *blockCounts
	leaks  interface{ leaks() map[string]int }
}

func (poolCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descSize, descResRanges, descAllocated, descBorrowed, descLent, descPending, descNodeFree, descOwned, descSticky, descIDs, descKept, descBlocks, descDisabled, descLeaks} {
		ch <- d
	}
}

func (c poolCollector) Collect(ch chan<- prometheus.Metric) {
	gauge := func(d *prometheus.Desc, v float64, l ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, l...)
	}
	disabled := map[string]bool{}
	for _, u := range c.usage.Usage() {
		l := []string{u.Pool, u.Family.String()}
		gauge(descSize, float64(u.Size), l...)
		gauge(descResRanges, float64(u.ReservedRanges), l...)
		gauge(descAllocated, float64(u.Used), l...)
		gauge(descBorrowed, float64(u.Borrowed), l...)
		gauge(descLent, float64(u.Lent), l...)
		gauge(descPending, float64(u.Reserved), l...)
		gauge(descNodeFree, float64(u.Free), l...)
		gauge(descOwned, float64(len(u.Blocks)), l...)
		gauge(descSticky, float64(u.Sticky), l...)
		gauge(descIDs, float64(u.Identities), l...)
		gauge(descKept, float64(u.Kept), l...)
		disabled[u.Pool] = u.Disabled
	}
	for pool, d := range disabled {
		v := 0.0
		if d {
			v = 1
		}
		gauge(descDisabled, v, pool)
	}
	if c.blocks != nil {
		for _, b := range c.blocks.get() {
			l := []string{b.pool, b.family.String()}
			gauge(descBlocks, float64(b.claimed), append(l, "claimed")...)
			gauge(descBlocks, float64(b.orphaned), append(l, "orphaned")...)
			gauge(descBlocks, float64(b.free), append(l, "free")...)
		}
	}
	if c.leaks != nil {
		for pool, n := range c.leaks.leaks() {
			gauge(descLeaks, float64(n), pool)
		}
	}
}

// blockCounts counts the blocks of the served pools by state, from one
// read of their claims and homes, kept for a while so that scrapes do not
// load etcd.
type blockCounts struct {
	pools interface{ served() []allocator.Pool }
	store interface {
		ListBlocks(ctx context.Context, pool string) ([]records.BlockInfo, error)
	}
	ttl time.Duration

	mu     sync.Mutex
	at     time.Time
	cached []poolBlocks
}

type poolBlocks struct {
	pool                    string
	family                  allocator.Family
	claimed, orphaned, free uint64
}

func (c *blockCounts) get() []poolBlocks {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.at.IsZero() && time.Since(c.at) < c.ttl {
		return c.cached
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	var out []poolBlocks
	for _, p := range c.pools.served() {
		infos, err := c.store.ListBlocks(ctx, p.Name)
		if err != nil {
			return c.cached // keep the last good answer
		}
		for _, f := range p.Families() {
			pb := poolBlocks{pool: p.Name, family: f}
			for _, bi := range infos {
				switch {
				case allocator.FamilyOf(bi.Block.Addr()) != f:
				case bi.Claim != nil:
					pb.claimed++
				case bi.Home != nil:
					pb.orphaned++
				}
			}
			pb.free = p.BlockCount(f) - min(p.BlockCount(f), pb.claimed+pb.orphaned)
			out = append(out, pb)
		}
	}
	c.cached, c.at = out, time.Now()
	return out
}

// servedPools are the specs of the pools this node knows, as the
// allocator holds them (they follow etcd).
type servedPools struct {
	alloc interface{ Pools() []allocator.Pool }
}

func (s servedPools) served() []allocator.Pool { return s.alloc.Pools() }
