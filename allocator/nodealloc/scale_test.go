package nodealloc_test

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
	"github.com/kvipam/kvipam/internal/tools/benchreport"
	"github.com/kvipam/kvipam/kvstore"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// conflictCounter counts claims lost to another node's (CAS conflicts),
// and claims that found the node's own claim: an earlier claim of the
// block whose answer was lost (a timeout), adopted.
type conflictCounter struct {
	records.Store
	n, own *atomic.Int64
}

func (c conflictCounter) Claim(ctx context.Context, pool string, b netip.Prefix, cl records.Claim, lease int64) (records.WriteResult, error) {
	res, err := c.Store.Claim(ctx, pool, b, cl, lease)
	var ce *records.ClaimError
	switch {
	case errors.As(err, &ce) && ce.ClaimedBy == cl.Node:
		c.own.Add(1)
	case errors.As(err, &ce):
		c.n.Add(1)
	}
	return res, err
}

// BenchmarkClaimStorm: KVIPAM_STORM_NODES node allocators (default
// 1,000), each with its own lease of KVIPAM_STORM_TTL seconds (default
// the agent's, 15) and sharing 16 clients, start at once on a /12 pool of
// /26 blocks (16,384 blocks) and each allocates one address, so each
// claims a block; on each etcd of KVIPAM_SCALE_ETCD (sub-benchmarks
// etcd=<name>, scaleBackends; etcd=cluster3 the default). Each etcd request is
// bounded by KVIPAM_CALL_TIMEOUT (default the agent's, 1 s), and each
// Allocate by KVIPAM_STORM_REQUEST_TIMEOUT (default 9 s: what the agent
// gives a request from a plugin with the default agentTimeout of 10 s,
// less its margin for the answer), inside which the allocator retries
// what etcd did not answer in time. With KVIPAM_STORM_RESERVE=1 each
// node does what the agent's first ADD does instead: a reservation, then
// its confirm, both under that deadline. The baseline, measured in the
// same run on the same etcd, is the same number of create-if-absent
// transactions at once, run before the storm and again after it (on the
// store the storm left), and is the two's mean.
// Reported: the storm's seconds and its ratio to the baseline, CAS
// conflicts (claims lost to another node), own claims found (a claim
// whose answer was lost, tried again and adopted), try-again answers
// (each a failure: the runtime would retry the pod's sandbox after a
// back-off), other failures, lost leases, leader elections during the
// storm, the leader's database size, the CPU seconds of this process and
// of the etcd members in the storm and in the baseline, this process's
// heap allocations a node and its GC cycles in each, the store calls
// by kind (count,
// calls etcd did not answer in time, p50, p99, the first one's end),
// claims-left (claims in etcd no node's answer stands on: one that
// landed for a call already answered "try again"), and
// duplicates and missing read back from etcd at the end (fleet.audit); a
// duplicate fails the benchmark. With KVIPAM_FILL_PROFILE set to a
// directory, CPU profiles of this process and of the leading member are
// written there: fleet-storm.pprof, etcd-storm.pprof (3 s from the
// storm's start) and fleet-storm-baseline.pprof, etcd-storm-baseline.pprof
// (2 s from the baseline's).
func BenchmarkClaimStorm(b *testing.B) {
	nodes := envInt(b, "KVIPAM_STORM_NODES", 1000)
	forEachBackend(b, func(b *testing.B, backend string) { claimStorm(b, backend, nodes) })
}

func claimStorm(b *testing.B, backend string, nodes int) {
	b.StopTimer()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	reqTimeout := 9 * time.Second
	if s := os.Getenv("KVIPAM_STORM_REQUEST_TIMEOUT"); s != "" {
		d, err := time.ParseDuration(s)
		if err != nil {
			b.Fatalf("KVIPAM_STORM_REQUEST_TIMEOUT: %v", err)
		}
		reqTimeout = d
	}
	f := newFleet(b, backend, "storm")
	var conflicts, own atomic.Int64
	steps := &stormSteps{}
	ttl := int64(envInt(b, "KVIPAM_STORM_TTL", 15))
	reserve := os.Getenv("KVIPAM_STORM_RESERVE") == "1"
	als, sessions := f.start(ctx, 0, nodes, ttl, func(st records.Store) records.Store {
		return timedStore{Store: conflictCounter{Store: st, n: &conflicts, own: &own}, s: steps}
	})
	clis := f.clis
	// The baseline runs on both sides of the storm, on the store before
	// it and on the store it left (its claims, its nodes' leases kept
	// alive), and is their mean: the store's growth is then in both.
	baseline := func(side string) (time.Duration, []float64) {
		return stormTimes(nodes, func(i int) error {
			_, err := etcdtest.CreateJSON(ctx, clis[i%len(clis)], fmt.Sprintf("/storm-floor-%s/%d", side, i), map[string]string{"owner": "x"})
			return err
		})
	}
	prof := f.startProfiles(ctx, 2*time.Second)
	cpu0 := f.sampleCPU()
	baseBefore, baseEnds := baseline("before")
	f.stopProfiles(prof, "storm-baseline")
	got := make([]*answer, nodes)
	var failed, tryAgain atomic.Int64
	var firstErr, firstTryAgain sync.Once
	baseCPU := f.sampleCPU().sub(cpu0)
	term := f.term(ctx)
	// A lease lost before the storm (its keepalives starved on a loaded
	// machine while the nodes started, or during the baseline) would fail
	// its node's Allocate at once and make the storm look fast: no figure
	// then.
	if n := lostSessions(sessions); n > 0 {
		b.Fatalf("%d of %d node leases lost before the storm: the machine is too loaded to keep them alive; no figure", n, nodes)
	}
	steps.start()
	prof = f.startProfiles(ctx, 3*time.Second)
	cpu0 = f.sampleCPU()
	b.StartTimer()
	took, ends := stormTimes(nodes, func(i int) error {
		// One Allocate per node, bounded as the agent bounds a request;
		// a try-again is a failure (a pod whose sandbox the runtime
		// retries after a back-off of seconds).
		rctx, cancel := context.WithTimeout(ctx, reqTimeout)
		defer cancel()
		r, err := als[i].Allocate(rctx, nodealloc.Request{Pool: "storm", Owner: owner(i), Reserve: reserve})
		if err == nil && reserve {
			var confirmed []records.Allocation
			if confirmed, err = als[i].Confirm(rctx, owner(i)); err == nil {
				r.Allocations = confirmed
			}
		}
		switch {
		case errors.Is(err, retry.ErrUnavailable):
			tryAgain.Add(1)
			firstTryAgain.Do(func() { b.Logf("try again: %s: %v", nodeName(i), err) })
			return nil
		case err != nil:
			failed.Add(1)
			firstErr.Do(func() { b.Logf("%s: %v", nodeName(i), err) })
			return nil
		}
		got[i] = &answer{node: nodeName(i), owner: owner(i), al: r.Allocations[0]}
		return nil
	})
	b.StopTimer()
	stormCPU := f.sampleCPU().sub(cpu0)
	f.stopProfiles(prof, "storm")
	elections := f.term(ctx) - term
	// Settle before the second baseline: a claim still in etcd's queue
	// when its node's call ended would land in it.
	time.Sleep(time.Second)
	left := f.claimsLeft(ctx, got)
	baseAfter, _ := baseline("after")
	base := (baseBefore + baseAfter) / 2
	lost := lostSessions(sessions)
	var answers []answer
	for _, a := range got {
		if a != nil {
			answers = append(answers, *a)
		}
	}
	// Read back while the leases, and so the claims, live.
	dups, missing := f.audit(ctx, answers)
	if dir := os.Getenv(benchreport.SamplesEnv); dir != "" {
		// Only the nodes answered with an address: a try-again is no
		// claim completed.
		var done []float64
		for i, a := range got {
			if a != nil {
				done = append(done, ends[i])
			}
		}
		st := benchreport.Storm{Nodes: nodes, CompletionsMS: done, BaselineCompletionsMS: baseEnds}
		if err := benchreport.WriteStorm(dir, fmt.Sprintf("%s-%d", backend, nodes), st); err != nil {
			b.Logf("write storm samples: %v", err)
		}
	}
	if st, err := f.status(ctx); err == nil {
		b.ReportMetric(float64(st.DbSize)/(1<<20), "db-mb")
		b.ReportMetric(float64(st.DbSizeInUse)/(1<<20), "db-in-use-mb")
	}
	if f.etcdRSS != nil {
		if rss, err := f.etcdRSS(); err == nil {
			b.ReportMetric(float64(rss)/(1<<20), "etcd-rss-mb")
		}
	}
	steps.report(b)
	b.ReportMetric(stormCPU.process.Seconds(), "process-cpu-s/storm")
	b.ReportMetric(baseCPU.process.Seconds(), "process-cpu-s/baseline")
	b.ReportMetric(float64(stormCPU.allocated)/float64(nodes), "process-alloc-B/node/storm")
	b.ReportMetric(float64(baseCPU.allocated)/float64(nodes), "process-alloc-B/node/baseline")
	b.ReportMetric(float64(stormCPU.gcs), "gc-cycles/storm")
	b.ReportMetric(float64(baseCPU.gcs), "gc-cycles/baseline")
	if f.etcdCPU != nil {
		b.ReportMetric(stormCPU.etcd.Seconds(), "etcd-cpu-s/storm")
		b.ReportMetric(baseCPU.etcd.Seconds(), "etcd-cpu-s/baseline")
	}
	b.ReportMetric(slices.Min(ends), "first-end-ms")
	b.ReportMetric(slices.Min(baseEnds), "baseline-first-end-ms")
	b.ReportMetric(took.Seconds(), "s/storm")
	b.ReportMetric(base.Seconds(), "s/baseline")
	b.ReportMetric(baseBefore.Seconds(), "s/baseline-before")
	b.ReportMetric(baseAfter.Seconds(), "s/baseline-after")
	b.ReportMetric(float64(left), "claims-left")
	b.ReportMetric(took.Seconds()/base.Seconds(), "x-baseline")
	b.ReportMetric(float64(conflicts.Load()), "conflicts")
	b.ReportMetric(float64(own.Load()), "own-claims-found")
	b.ReportMetric(float64(failed.Load()), "failures")
	b.ReportMetric(float64(tryAgain.Load()), "try-again")
	b.ReportMetric(float64(lost), "lost-leases")
	b.ReportMetric(float64(f.restoreRetries.Load()), "start-retries")
	b.ReportMetric(float64(elections), "elections")
	b.ReportMetric(float64(dups), "duplicates")
	b.ReportMetric(float64(missing), "missing")
	if dups > 0 {
		b.Fatalf("%d duplicates read back from etcd", dups)
	}
}

// lostSessions counts the sessions whose lease is lost.
func lostSessions(sessions []*kvstore.Session) int {
	n := 0
	for _, s := range sessions {
		if s.Lost() {
			n++
		}
	}
	return n
}

// claimsLeft counts the claims in etcd that no node's answer stands on:
// claims of the pool, less the blocks answered (got[i] is node i's
// answer, nil if it had none). A claim whose answer was lost, and that
// its node neither used nor gave back, is one.
func (f *fleet) claimsLeft(ctx context.Context, got []*answer) int {
	blocks, err := etcdstore.New(f.clis[0], etcdstore.Options{}).ListBlocks(ctx, f.pool)
	if err != nil {
		f.b.Fatalf("claims left: %v", err)
	}
	answered := map[netip.Prefix]bool{}
	for _, a := range got {
		if a != nil {
			answered[a.al.Block] = true
		}
	}
	left := 0
	for _, bi := range blocks {
		if bi.Claim != nil && !answered[bi.Block] {
			left++
		}
	}
	return left
}

// BenchmarkFill fills a /12 pool of /26 blocks from KVIPAM_FILL_NODES node
// allocators (default 5,000), KVIPAM_FILL_ADDRS addresses each (default
// 30), on each etcd of KVIPAM_SCALE_ETCD (fleet.fill). A node's claims
// must not cost more as the pool fills (no claim re-reads every claim of
// the pool): reported are the first and the last group's seconds and
// their ratio (the baseline is the first group, same run).
func BenchmarkFill(b *testing.B) {
	nodes, addrs := envInt(b, "KVIPAM_FILL_NODES", 5000), envInt(b, "KVIPAM_FILL_ADDRS", 30)
	forEachBackend(b, func(b *testing.B, backend string) {
		b.StopTimer()
		f := newFleet(b, backend, "fill")
		r := f.fill(context.Background(), nodes, addrs)
		r.report(b, "failures")
	})
}

// filled is what fleet.fill did.
type filled struct {
	als   []*nodealloc.Allocator
	times []time.Duration
	// rawTimes are the raw groups' (fleet.rawGroup), one after each group.
	rawTimes []time.Duration
	// cpu and rawCPU are where each group's and each raw group's CPU
	// went.
	cpu, rawCPU []cpuSample
	failed      int64
	answers     []answer
	// unanswered are the owners whose Allocate failed: its write may
	// have landed after all (an unknown outcome), so a node restored
	// from etcd may hold them.
	unanswered map[records.Owner]bool
}

// report reports the fill's groups, its raw groups, their CPU and its
// failures (as the metric failures names).
func (r filled) report(b *testing.B, failures string) {
	b.ReportMetric(r.times[0].Seconds(), "s/first-group")
	b.ReportMetric(r.times[len(r.times)-1].Seconds(), "s/last-group")
	b.ReportMetric(float64(r.times[len(r.times)-1])/float64(r.times[0]), "x-first")
	r.reportRaw(b)
	r.reportCPU(b)
	b.ReportMetric(float64(r.failed), failures)
}

// reportCPU reports the CPU seconds, the fleet process's and the etcd
// members', of the first and the last group and raw group. On a machine
// whose cores they fill, a group's time is their sum over the cores.
func (r filled) reportCPU(b *testing.B) {
	for _, g := range []struct {
		name string
		cpu  []cpuSample
	}{{"group", r.cpu}, {"raw-group", r.rawCPU}} {
		first, last := g.cpu[0], g.cpu[len(g.cpu)-1]
		b.ReportMetric(first.process.Seconds(), "process-cpu-s/first-"+g.name)
		b.ReportMetric(last.process.Seconds(), "process-cpu-s/last-"+g.name)
		if first.etcd > 0 {
			b.ReportMetric(first.etcd.Seconds(), "etcd-cpu-s/first-"+g.name)
			b.ReportMetric(last.etcd.Seconds(), "etcd-cpu-s/last-"+g.name)
		}
	}
}

// reportRaw reports the raw groups: the same growth measured on bare
// transactions, what etcd and this process add as the store fills.
func (r filled) reportRaw(b *testing.B) {
	b.ReportMetric(r.rawTimes[0].Seconds(), "s/first-raw-group")
	b.ReportMetric(r.rawTimes[len(r.rawTimes)-1].Seconds(), "s/last-raw-group")
	b.ReportMetric(float64(r.rawTimes[len(r.rawTimes)-1])/float64(r.rawTimes[0]), "x-first-raw")
}

// rawCreate is the baseline of one allocation: a create-if-absent
// transaction of key with an allocation's record of owner number n on
// node i, on node i's client.
func (f *fleet) rawCreate(ctx context.Context, i, n int, key string) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	rec := records.Record{Owner: owner(n), Node: nodeName(i), State: records.StateAllocated, Since: time.Now().UTC()}
	_, err := etcdtest.CreateJSON(ctx, f.clis[i%len(f.clis)], key, rec)
	return err
}

// rawGroup is a fill group's baseline on the store as it is: n
// goroutines at once, each making addrs create-if-absent transactions of
// an allocation-sized record one after another, on the fleet's clients;
// the keys are deleted and compacted after it (the database file keeps
// the pages it grew by; db-in-use-mb does not count them). It returns how
// long they took and the CPU they used.
func (f *fleet) rawGroup(ctx context.Context, n, addrs int) (time.Duration, cpuSample) {
	const prefix = "/raw-fill/"
	var failed atomic.Int64
	before := f.sampleCPU()
	took := storm(n, func(i int) error {
		for k := range addrs {
			if err := f.rawCreate(ctx, i, i*addrs+k, fmt.Sprintf("%s%d/%d", prefix, i, k)); err != nil {
				failed.Add(1)
				return err
			}
		}
		return nil
	})
	cpu := f.sampleCPU().sub(before)
	del, err := f.clis[0].Delete(ctx, prefix, clientv3.WithPrefix())
	if err != nil {
		f.b.Fatalf("delete the raw group: %v", err)
	}
	// Compact its history away, so that the store's size is the fill's
	// (allocations are written once: compaction takes nothing of theirs).
	if _, err := f.clis[0].Compact(ctx, del.Header.Revision, clientv3.WithCompactPhysical()); err != nil {
		f.b.Fatalf("compact the raw group away: %v", err)
	}
	if n := failed.Load(); n > 0 {
		f.b.Logf("raw group: %d nodes stopped on a failed transaction", n)
	}
	return took, cpu
}

// fill starts nodes node allocators (leases of 60 s), 1,000 at a time (a
// fifth of them, if fewer), each group allocating addrs addresses a node
// at once, its nodes' requests one after another. Only the groups'
// allocations run with the benchmark's timer on.
func (f *fleet) fill(ctx context.Context, nodes, addrs int) filled {
	group := min(1000, max(nodes/5, 1))
	r := filled{unanswered: map[records.Owner]bool{}}
	var failed atomic.Int64
	var mu sync.Mutex
	for first := 0; first < nodes; first += group {
		n := min(group, nodes-first)
		var conflicts, own atomic.Int64
		als, _ := f.start(ctx, first, n, 60, func(st records.Store) records.Store {
			st = conflictCounter{Store: st, n: &conflicts, own: &own}
			if f.steps != nil {
				st = timedStore{Store: st, s: f.steps}
			}
			return st
		})
		before := f.sampleCPU()
		time.Sleep(time.Second)
		idle := f.sampleCPU().sub(before)
		var prof *groupProfile
		if first == 0 || first+n >= nodes {
			prof = f.startProfiles(ctx, 5*time.Second)
		}
		before = f.sampleCPU()
		f.b.StartTimer()
		took := storm(n, func(i int) error {
			got := make([]answer, 0, addrs)
			for k := range addrs {
				o := owner((first+i)*addrs + k)
				res, err := als[i].Allocate(ctx, nodealloc.Request{Pool: f.pool, Owner: o})
				if err != nil {
					failed.Add(1)
					mu.Lock()
					r.unanswered[o] = true
					mu.Unlock()
					continue
				}
				got = append(got, answer{node: nodeName(first + i), owner: o, al: res.Allocations[0]})
			}
			mu.Lock()
			r.answers = append(r.answers, got...)
			mu.Unlock()
			return nil
		})
		f.b.StopTimer()
		cpu := f.sampleCPU().sub(before)
		if first == 0 {
			f.stopProfiles(prof, "first-group")
		} else {
			f.stopProfiles(prof, "last-group")
		}
		raw, rawCPU := f.rawGroup(ctx, n, addrs)
		f.b.Logf("fill: nodes %d-%d: %v (%d failed so far, %d claims lost to conflicts); the raw group after it %v; an idle second %v",
			first, first+n-1, cpu, failed.Load(), conflicts.Load(), rawCPU, idle)
		r.times, r.rawTimes = append(r.times, took), append(r.rawTimes, raw)
		r.cpu, r.rawCPU = append(r.cpu, cpu), append(r.rawCPU, rawCPU)
		r.als = append(r.als, als...)
	}
	r.failed = failed.Load()
	return r
}
