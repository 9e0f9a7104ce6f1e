package nodealloc_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// BenchmarkSteady is issue 20's steady phase on a filled store, on each
// etcd of KVIPAM_SCALE_ETCD (sub-benchmarks etcd=<name>, scaleBackends;
// etcd=cluster3 the default):
//
//   - the fill of BenchmarkFill: KVIPAM_FILL_NODES node allocators
//     (default 5,000) x KVIPAM_FILL_ADDRS addresses (default 30), reported
//     as s/first-group, s/last-group, x-first and fill-failures, and
//     after each group a raw group (fleet.rawGroup, the same shape of
//     bare transactions) as s/first-raw-group, s/last-raw-group and
//     x-first-raw: how much of the growth etcd and the process bring;
//   - allocations at a steady open-loop KVIPAM_STEADY_RATE a second
//     (default 500), each by a node picked at random, and in alternate
//     100 ms slices as many raw create-if-absent transactions (one
//     key, If(CreateRevision==0) Then(Put), a value the size of an
//     allocation's) a second on the same clients: the baseline. Each kind
//     runs KVIPAM_STEADY_SECONDS (default 10). Reported: alloc-p50-ms,
//     alloc-p99-ms, raw-p50-ms, raw-p99-ms, x-raw-p99 (the p99s' ratio)
//     and steady-failures (timeouts: 10 s);
//   - a sweep of KVIPAM_SWEEP_RATES (default 100,250,500,750,1000,1500,2000;
//     0 skips it), KVIPAM_SWEEP_SECONDS each kind (default 3), in four
//     kinds of slices in turn (loadGen.sweep): allocations, bare creates,
//     releases of the sweep's oldest live owners, bare deletes guarded by
//     revision. Reported per rate: r<rate>-<kind>-p99-ms,
//     r<rate>-alloc-txn-p99-ms and r<rate>-release-txn-p99-ms (the
//     allocators' own transactions), r<rate>-failures; and the highest
//     rate each kind holds under 50 ms p99 (max-rate-under-50ms for
//     allocations, raw-, release-, rawdel-max-rate-under-50ms),
//     max-rate-vs-raw, and the largest p99 ratios to the baselines where
//     bare creates hold 50 ms (alloc-, release-p99-vs-raw-max and
//     p99-vs-raw-max); the sweep stops at a rate whose allocation or
//     bare p99 passes 250 ms;
//   - db-size-mb and db-in-use-mb (10^6 bytes) of the leader's database;
//   - restart-ms (median) and restart-max-ms over KVIPAM_RESTARTS
//     (default 5) filled nodes, one at a time on the idle store: what an
//     agent's start costs the allocator on a store this size (a new lease,
//     a new NodeAllocator, its Restore: the pool's claims and homes, its
//     block re-claimed from the old lease, the block's allocations). The
//     restored node must know every allocation it answered. start-retries
//     counts the node starts (fill and restarts) whose restore etcd did
//     not answer within the call timeout, tried again as the agent does;
//   - elections during the benchmark, and duplicates and missing read
//     back from etcd at the end (fleet.audit): a duplicate fails it.
//
// An allocation is one Allocate of a permanent address (the agent's
// Permanent requests; an ADD's reservation is the same write on a
// reservation lease, confirmed later by a second one).
func BenchmarkSteady(b *testing.B) {
	nodes, addrs := envInt(b, "KVIPAM_FILL_NODES", 5000), envInt(b, "KVIPAM_FILL_ADDRS", 30)
	rate := envInt(b, "KVIPAM_STEADY_RATE", 500)
	secs := time.Duration(envInt(b, "KVIPAM_STEADY_SECONDS", 10)) * time.Second
	rates := envInts(b, "KVIPAM_SWEEP_RATES", "100,250,500,750,1000,1500,2000")
	sweepSecs := time.Duration(envInt(b, "KVIPAM_SWEEP_SECONDS", 3)) * time.Second
	restarts := envInt(b, "KVIPAM_RESTARTS", 5)
	if rate <= 0 || slices.ContainsFunc(rates, func(r int) bool { return r < 0 }) {
		b.Fatalf("KVIPAM_STEADY_RATE %d, KVIPAM_SWEEP_RATES %v: rates are positive", rate, rates)
	}
	forEachBackend(b, func(b *testing.B, backend string) {
		b.StopTimer()
		ctx := context.Background()
		f := newFleet(b, backend, "steady")
		f.steps = &stormSteps{}
		term := f.term(ctx)
		r := f.fill(ctx, nodes, addrs)
		r.report(b, "fill-failures")

		g := &loadGen{f: f, als: r.als, next: int64(nodes * addrs), steps: f.steps}
		lat := g.run(ctx, rate, secs, kindAlloc, kindRaw)
		al, raw := lat[kindAlloc], lat[kindRaw]
		b.Logf("%d/s for %v each: allocation p50 %.2f ms p99 %.2f ms (%d); raw p50 %.2f ms p99 %.2f ms (%d)",
			rate, secs, ms(quantile(al, 0.5)), ms(quantile(al, 0.99)), len(al), ms(quantile(raw, 0.5)), ms(quantile(raw, 0.99)), len(raw))
		b.ReportMetric(ms(quantile(al, 0.5)), "alloc-p50-ms")
		b.ReportMetric(ms(quantile(al, 0.99)), "alloc-p99-ms")
		b.ReportMetric(ms(quantile(raw, 0.5)), "raw-p50-ms")
		b.ReportMetric(ms(quantile(raw, 0.99)), "raw-p99-ms")
		b.ReportMetric(float64(quantile(al, 0.99))/float64(quantile(raw, 0.99)), "x-raw-p99")
		b.ReportMetric(float64(g.failed.Swap(0)), "steady-failures")

		if !slices.Equal(rates, []int{0}) {
			b.ReportMetric(float64(g.sweep(ctx, b, rates, sweepSecs)), "max-rate-under-50ms")
		}

		st, err := f.status(ctx)
		if err != nil {
			b.Fatal(err)
		}
		b.ReportMetric(float64(st.DbSize)/1e6, "db-size-mb")
		b.ReportMetric(float64(st.DbSizeInUse)/1e6, "db-in-use-mb")

		med, worst := f.restartCost(ctx, r.als, restarts, r.unanswered)
		b.ReportMetric(ms(med), "restart-ms")
		b.ReportMetric(ms(worst), "restart-max-ms")
		b.ReportMetric(float64(f.restoreRetries.Load()), "start-retries")

		b.ReportMetric(float64(f.term(ctx)-term), "elections")
		dups, missing := f.audit(ctx, append(r.answers, g.answers...))
		b.ReportMetric(float64(dups), "duplicates")
		b.ReportMetric(float64(missing), "missing")
		if dups > 0 {
			b.Fatalf("%d duplicates read back from etcd", dups)
		}
	})
}

// loadGen sends a steady, open-loop load of allocations and releases
// (by the fleet's node allocators) and their raw baselines.
type loadGen struct {
	f      *fleet
	als    []*nodealloc.Allocator
	next   int64 // owner numbers of the load: from the fill's last on
	seq    atomic.Int64
	failed atomic.Int64
	// steps times the allocators' store calls (their transactions) while
	// a sweep rate runs.
	steps *stormSteps

	mu      sync.Mutex
	answers []answer // live allocations of the load, oldest first
	rawKeys []rawKey // live raw keys, oldest first
	skipped int      // releases with nothing to release
}

// rawKey is a raw transaction's key and the revision it was created at.
type rawKey struct {
	key string
	rev int64
}

// The kinds of request the load sends, each in slices of its own.
const (
	kindAlloc   = "alloc"   // Allocate of a new owner, by a random node
	kindRaw     = "raw"     // a bare create-if-absent, the allocation's baseline
	kindRelease = "release" // Release of the load's oldest live owner, by its node
	kindRawDel  = "rawdel"  // a bare delete guarded by the key's revision, the release's baseline
)

// slice is how long the load runs one kind before the next: short, so
// that a stall of etcd's (a compaction's batch, a snapshot, a slow fsync)
// or of this process's (a GC of the fleet's heap) longer than a slice
// lands on every kind rather than on whichever ran then.
const slice = 100 * time.Millisecond

// run sends rate requests a second, in turn in slices of each of kinds,
// for d of each kind. It is open loop: each request starts at its
// scheduled time whether or not earlier ones have answered, and its
// latency counts from that time, so a backlog shows in the latencies
// instead of slowing the load down.
func (g *loadGen) run(ctx context.Context, rate int, d time.Duration, kinds ...string) map[string][]time.Duration {
	perSlice := max(1, rate*int(slice/time.Millisecond)/1000)
	interval := time.Second / time.Duration(rate)
	out := map[string][]time.Duration{}
	var wg sync.WaitGroup
	var mu sync.Mutex
	began, k := time.Now(), 0
	for s := range len(kinds) * max(1, int(d/slice)) {
		kind := kinds[s%len(kinds)]
		op := map[string]func(context.Context) error{kindAlloc: g.allocate, kindRaw: g.raw, kindRelease: g.release, kindRawDel: g.rawDelete}[kind]
		for range perSlice {
			at := began.Add(time.Duration(k) * interval)
			k++
			time.Sleep(time.Until(at))
			wg.Go(func() {
				if err := op(ctx); errors.Is(err, errNothingLive) {
					return
				} else if err != nil {
					g.failed.Add(1)
					return
				}
				lat := time.Since(at)
				mu.Lock()
				defer mu.Unlock()
				out[kind] = append(out[kind], lat)
			})
		}
	}
	wg.Wait()
	return out
}

// errNothingLive: a release found no live owner or key of the load.
var errNothingLive = errors.New("nothing live to release")

// allocate is one allocation of a new owner by a node picked at random.
func (g *loadGen) allocate(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	al := g.als[rand.IntN(len(g.als))]
	o := owner(int(g.next + g.seq.Add(1)))
	r, err := al.Allocate(ctx, nodealloc.Request{Pool: g.f.pool, Owner: o})
	if err != nil {
		return err
	}
	g.mu.Lock()
	g.answers = append(g.answers, answer{node: r.Allocations[0].Node, owner: o, al: r.Allocations[0]})
	g.mu.Unlock()
	return nil
}

// release releases the load's oldest live owner, by its node.
func (g *loadGen) release(ctx context.Context) error {
	g.mu.Lock()
	if len(g.answers) == 0 {
		g.skipped++
		g.mu.Unlock()
		return errNothingLive
	}
	a := g.answers[0]
	g.answers = g.answers[1:]
	g.mu.Unlock()
	var i int
	if _, err := fmt.Sscanf(a.node, "node-%d", &i); err != nil || i >= len(g.als) {
		return fmt.Errorf("release: no node %q", a.node)
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	_, err := g.als[i].Release(ctx, a.owner)
	return err
}

// raw is the baseline: one create-if-absent transaction of a new key,
// whose value is an allocation record's, on a client picked at random.
func (g *loadGen) raw(ctx context.Context) error {
	n := g.next + g.seq.Add(1)
	key := fmt.Sprintf("/raw-floor/%d", n)
	i := rand.IntN(len(g.als))
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	rec := records.Record{Owner: owner(int(n)), Node: nodeName(i), State: records.StateAllocated, Since: time.Now().UTC()}
	rev, err := etcdtest.CreateJSON(ctx, g.f.clis[i%len(g.f.clis)], key, rec)
	if err != nil {
		return err
	}
	g.mu.Lock()
	g.rawKeys = append(g.rawKeys, rawKey{key: key, rev: rev})
	g.mu.Unlock()
	return nil
}

// rawDelete is the release's baseline: the oldest live raw key deleted
// in a transaction guarded by its revision, on a client picked at random.
func (g *loadGen) rawDelete(ctx context.Context) error {
	g.mu.Lock()
	if len(g.rawKeys) == 0 {
		g.skipped++
		g.mu.Unlock()
		return errNothingLive
	}
	k := g.rawKeys[0]
	g.rawKeys = g.rawKeys[1:]
	g.mu.Unlock()
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	cli := g.f.clis[rand.IntN(len(g.f.clis))]
	resp, err := cli.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(k.key), "=", k.rev)).Then(clientv3.OpDelete(k.key)).Commit()
	if err == nil && !resp.Succeeded {
		err = fmt.Errorf("raw delete %s: changed", k.key)
	}
	return err
}

// sweepRate is what one rate of the sweep measured: each kind's p99,
// and the p99 of the allocators' transactions (the store calls inside
// an allocation and a release).
type sweepRate struct {
	rate                       int
	p99                        map[string]time.Duration
	writeP99, deleteP99        time.Duration
	failed                     int64
	allocs, raws, rels, rawdel int
}

// sweep runs the load at each rate, every kind for d, and reports each
// rate's p99s, the highest rate whose allocation p99 (and the bare
// creates', releases', bare deletes') is under 50 ms with no failure,
// and the largest ratio of kvipam's p99 to its baseline's at the rates
// where the bare creates' p99 is under 50 ms (the sweep stops at a rate
// whose allocation or bare p99 passes 250 ms). It returns the
// allocation's highest rate.
func (g *loadGen) sweep(ctx context.Context, b *testing.B, rates []int, d time.Duration) int {
	best := map[string]int{}
	worst := map[string]float64{}
	for _, rate := range rates {
		if rate == 0 {
			continue
		}
		g.steps.start()
		lat := g.run(ctx, rate, d, kindAlloc, kindRaw, kindRelease, kindRawDel)
		write, del := g.steps.p99("write"), g.steps.p99("delete")
		g.steps.stop()
		failed := g.failed.Swap(0)
		p99 := map[string]time.Duration{}
		for _, k := range []string{kindAlloc, kindRaw, kindRelease, kindRawDel} {
			p99[k] = quantile(lat[k], 0.99)
			b.ReportMetric(ms(p99[k]), fmt.Sprintf("r%d-%s-p99-ms", rate, k))
			if len(lat[k]) > 0 && failed == 0 && p99[k] < 50*time.Millisecond {
				best[k] = max(best[k], rate)
			}
		}
		b.ReportMetric(ms(write), fmt.Sprintf("r%d-alloc-txn-p99-ms", rate))
		b.ReportMetric(ms(del), fmt.Sprintf("r%d-release-txn-p99-ms", rate))
		b.ReportMetric(float64(failed), fmt.Sprintf("r%d-failures", rate))
		b.Logf("sweep %d/s: allocation p99 %.2f ms (%d; its transaction %.2f ms), raw %.2f ms (%d); release p99 %.2f ms (%d; its transaction %.2f ms), raw delete %.2f ms (%d); %d failures",
			rate, ms(p99[kindAlloc]), len(lat[kindAlloc]), ms(write), ms(p99[kindRaw]), len(lat[kindRaw]),
			ms(p99[kindRelease]), len(lat[kindRelease]), ms(del), ms(p99[kindRawDel]), len(lat[kindRawDel]), failed)
		if p99[kindRaw] > 0 && p99[kindRaw] < 50*time.Millisecond {
			for k, base := range map[string]string{kindAlloc: kindRaw, kindRelease: kindRawDel} {
				if p99[base] > 0 && p99[k] > 0 {
					worst[k] = max(worst[k], float64(p99[k])/float64(p99[base]))
				}
			}
		}
		if p99[kindAlloc] > 250*time.Millisecond || p99[kindRaw] > 250*time.Millisecond {
			b.Logf("sweep stopped: past saturation")
			break
		}
	}
	b.ReportMetric(float64(best[kindRaw]), "raw-max-rate-under-50ms")
	b.ReportMetric(float64(best[kindRelease]), "release-max-rate-under-50ms")
	b.ReportMetric(float64(best[kindRawDel]), "rawdel-max-rate-under-50ms")
	b.ReportMetric(worst[kindAlloc], "alloc-p99-vs-raw-max")
	b.ReportMetric(worst[kindRelease], "release-p99-vs-raw-max")
	b.ReportMetric(max(worst[kindAlloc], worst[kindRelease]), "p99-vs-raw-max")
	if best[kindRaw] > 0 {
		b.ReportMetric(float64(best[kindAlloc])/float64(best[kindRaw]), "max-rate-vs-raw")
	}
	g.mu.Lock()
	b.ReportMetric(float64(g.skipped), "sweep-releases-skipped")
	g.mu.Unlock()
	return best[kindAlloc]
}

// restartCost starts n of the nodes of als anew, one at a time (fleet.
// startNode: a lease, an allocator, its Restore), and returns the median
// and the longest start. A restored node must hold what it held before,
// and more only for owners whose Allocate failed (unanswered): a write
// that landed after its call gave up is in etcd, and so in the restore.
func (f *fleet) restartCost(ctx context.Context, als []*nodealloc.Allocator, n int, unanswered map[records.Owner]bool) (median, worst time.Duration) {
	var took []time.Duration
	for j := range min(n, len(als)) {
		i := j * len(als) / n
		held := map[records.Owner]bool{}
		for _, a := range als[i].Allocations() {
			held[a.Owner] = true
		}
		began := time.Now()
		al, _, err := f.startNode(ctx, i, 60, nil)
		took = append(took, time.Since(began))
		if err != nil {
			f.b.Fatalf("restart %s: %v", nodeName(i), err)
		}
		restored := map[records.Owner]bool{}
		for _, a := range al.Allocations() {
			restored[a.Owner] = true
			if !held[a.Owner] && !unanswered[a.Owner] {
				f.b.Fatalf("restart %s: restored %s's allocation, which it did not hold and no failed call made", nodeName(i), a.Owner.Key())
			}
		}
		for o := range held {
			if !restored[o] {
				f.b.Fatalf("restart %s: %s's allocation was not restored", nodeName(i), o.Key())
			}
		}
		if extra := len(restored) - len(held); extra > 0 {
			f.b.Logf("restart %s: restored %d allocations of calls that failed (their writes landed)", nodeName(i), extra)
		}
		als[i] = al // the old one's claim is gone to the new lease
	}
	if len(took) == 0 {
		return 0, 0
	}
	return quantile(took, 0.5), slices.Max(took)
}
