package allocator_test

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/kvstore"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// conflictCounter counts claims lost to another node's (CAS conflicts).
type conflictCounter struct {
	allocator.Store
	n *atomic.Int64
}

func (c conflictCounter) Claim(ctx context.Context, pool string, b netip.Prefix, cl allocator.Claim, lease int64) (int64, error) {
	rev, err := c.Store.Claim(ctx, pool, b, cl, lease)
	var ce *allocator.ClaimError
	if errors.As(err, &ce) {
		c.n.Add(1)
	}
	return rev, err
}

// BenchmarkClaimStorm: KVIPAM_STORM_NODES node allocators (default
// 1,000), each with its own lease of the agent's default TTL (15 s) and
// sharing 16 clients, start at once on a /12 pool of /26 blocks (16,384
// blocks) and each allocates one address, so each claims a block. The
// baseline, measured in the same run on the same etcd, is the same
// number of create-if-absent transactions at once. Reported: the storm's
// seconds and its ratio to the baseline, CAS conflicts, try-again
// answers (retried, as a runtime retries them), failures and lost
// leases; a duplicate address fails the benchmark.
func BenchmarkClaimStorm(b *testing.B) {
	nodes := envInt(b, "KVIPAM_STORM_NODES", 1000)
	for range b.N {
		b.StopTimer()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
		f := newFleet(b, "storm")
		var conflicts atomic.Int64
		als, sessions := f.start(ctx, 0, nodes, 15, func(st allocator.Store) allocator.Store { return conflictCounter{Store: st, n: &conflicts} })
		clis := f.clis
		base := storm(nodes, func(i int) error {
			_, err := kvstore.CreateJSON(ctx, clis[i%len(clis)], fmt.Sprintf("/storm-floor/%d", i), map[string]string{"owner": "x"})
			return err
		})
		got := make([]netip.Addr, nodes)
		var failed atomic.Int64
		var firstErr sync.Once
		b.StartTimer()
		var tryAgain atomic.Int64
		took := storm(nodes, func(i int) error {
			// A try-again (a call past its deadline on this loaded etcd) is
			// retried after a back-off, as the runtime retries CNI code 11,
			// and counted.
			r, err := als[i].Allocate(ctx, allocator.Request{Pool: "storm", Owner: owner(i)})
			for try := 0; try < 5 && errors.Is(err, allocator.ErrUnavailable); try++ {
				tryAgain.Add(1)
				time.Sleep(time.Duration(try+1) * 250 * time.Millisecond) // the runtime's back-off
				r, err = als[i].Allocate(ctx, allocator.Request{Pool: "storm", Owner: owner(i)})
			}
			if err != nil {
				failed.Add(1)
				firstErr.Do(func() { b.Logf("node-%05d: %v", i, err) })
				return nil
			}
			got[i] = r.Allocations[0].Addr
			return nil
		})
		b.StopTimer()
		lost := 0
		for _, s := range sessions {
			if s.Lost() {
				lost++
			}
			s.Close()
		}
		seen := map[netip.Addr]bool{}
		for _, a := range got {
			if a.IsValid() && seen[a] {
				b.Fatalf("%s handed out twice", a)
			}
			seen[a] = true
		}
		cancel()
		b.ReportMetric(took.Seconds(), "s/storm")
		b.ReportMetric(base.Seconds(), "s/baseline")
		b.ReportMetric(took.Seconds()/base.Seconds(), "x-baseline")
		b.ReportMetric(float64(conflicts.Load()), "conflicts")
		b.ReportMetric(float64(failed.Load()), "failures")
		b.ReportMetric(float64(tryAgain.Load()), "try-again")
		b.ReportMetric(float64(lost), "lost-leases")
	}
}

// fleet is an etcd, a /12 pool of /26 blocks named pool, and 16 clients
// that simulated nodes share.
type fleet struct {
	b    *testing.B
	pool string
	clis []*clientv3.Client
}

func newFleet(b *testing.B, pool string) *fleet {
	e := etcdtest.Start(b)
	ensurePool(b, e, allocator.Pool{Name: pool, CIDRs: []netip.Prefix{netip.MustParsePrefix("10.32.0.0/12")}, BlockSizeV4: 26})
	f := &fleet{b: b, pool: pool, clis: make([]*clientv3.Client, 16)}
	for i := range f.clis {
		f.clis[i] = etcdtest.Client(b, e)
	}
	return f
}

// start restores n node allocators, node-<first> on, each on its own lease
// of ttl seconds; wrap, if set, wraps each one's store.
func (f *fleet) start(ctx context.Context, first, n int, ttl int64, wrap func(allocator.Store) allocator.Store) ([]*allocator.NodeAllocator, []*kvstore.Session) {
	als := make([]*allocator.NodeAllocator, n)
	sessions := make([]*kvstore.Session, n)
	for i := range als {
		cli := f.clis[(first+i)%len(f.clis)]
		sess, err := kvstore.NewSession(ctx, cli, ttl)
		if err != nil {
			f.b.Fatal(err)
		}
		f.b.Cleanup(sess.Close)
		var st allocator.Store = etcdstore.New(cli, etcdstore.Options{})
		if wrap != nil {
			st = wrap(st)
		}
		al, err := allocator.NewNodeAllocator(allocator.NodeConfig{Node: fmt.Sprintf("node-%05d", first+i), Store: st, Pools: []string{f.pool}})
		if err != nil {
			f.b.Fatal(err)
		}
		if err := al.Restore(ctx, sess); err != nil {
			f.b.Fatal(err)
		}
		als[i], sessions[i] = al, sess
	}
	return als, sessions
}

// storm runs f for 0..n-1 at once and returns how long all took.
func storm(n int, f func(i int) error) time.Duration {
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			<-start
			_ = f(i)
		})
	}
	began := time.Now()
	close(start)
	wg.Wait()
	return time.Since(began)
}

// BenchmarkFill fills a /12 pool of /26 blocks from KVIPAM_FILL_NODES node
// allocators (default 5,000), KVIPAM_FILL_ADDRS addresses each (default
// 30), started 1,000 at a time (a fifth of them, if fewer), each group
// allocating at once. A node's
// claims must not cost more as the pool fills (no claim re-reads every
// claim of the pool): reported are the first and the last group's
// seconds and their ratio (the baseline is the first group, same run).
func BenchmarkFill(b *testing.B) {
	nodes, addrs := envInt(b, "KVIPAM_FILL_NODES", 5000), envInt(b, "KVIPAM_FILL_ADDRS", 30)
	group := min(1000, max(nodes/5, 1))
	for range b.N {
		b.StopTimer()
		f := newFleet(b, "fill")
		ctx := context.Background()
		var times []time.Duration
		var failed atomic.Int64
		for first := 0; first < nodes; first += group {
			n := min(group, nodes-first)
			als, _ := f.start(ctx, first, n, 60, nil)
			b.StartTimer()
			took := storm(n, func(i int) error {
				for k := range addrs {
					if _, err := als[i].Allocate(ctx, allocator.Request{Pool: "fill", Owner: owner((first+i)*addrs + k)}); err != nil {
						failed.Add(1)
					}
				}
				return nil
			})
			b.StopTimer()
			times = append(times, took)
		}
		b.ReportMetric(times[0].Seconds(), "s/first-group")
		b.ReportMetric(times[len(times)-1].Seconds(), "s/last-group")
		b.ReportMetric(float64(times[len(times)-1])/float64(times[0]), "x-first")
		b.ReportMetric(float64(failed.Load()), "failures")
	}
}

func envInt(b *testing.B, name string, def int) int {
	s := os.Getenv(name)
	if s == "" {
		return def
	}
	v, err := strconv.Atoi(s)
	if err != nil {
		b.Fatalf("%s: %v", name, err)
	}
	return v
}
