package nodealloc_test

import (
	"context"
	"fmt"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/kvstore"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// The tight-pool scenario of the public cross-project IPAM benchmark:
// 1,000 pods on 10 nodes, a pool with exactly as many usable addresses as
// pods (a /22 of 16 blocks of 64, 1,022 usable, 22 reserved), all created
// at once, all deleted and created again at once, then every node
// restarted at once. A block-per-node IPAM fails here: 10 nodes that each
// need 100 addresses want 20 blocks of a pool that has 16.
const (
	tightNodes = 10
	tightPods  = 1000
)

func tightPool(name string) allocator.Pool {
	return allocator.Pool{
		Name: name, CIDRs: []netip.Prefix{netip.MustParsePrefix("10.70.0.0/22")}, BlockSizeV4: 26,
		Reserved: []allocator.Reservation{{Range: allocator.AddrRange{First: netip.MustParseAddr("10.70.3.233"), Last: netip.MustParseAddr("10.70.3.254")}, Reason: "exactly 1000 left"}},
	}
}

// tightRun is one run of the scenario; each phase's duration and failures
// are kept for the test and the benchmark.
type tightRun struct {
	t        testing.TB
	e        *kvstore.Embedded
	pool     string
	nodes    []*testNode
	held     []netip.Addr // by pod
	failures []error
}

func newTightRun(t testing.TB, e *kvstore.Embedded, p allocator.Pool) *tightRun {
	ensurePool(t, e, p)
	r := &tightRun{t: t, e: e, pool: p.Name, held: make([]netip.Addr, tightPods)}
	r.start()
	return r
}

func (r *tightRun) start() {
	r.nodes = make([]*testNode, tightNodes)
	var wg sync.WaitGroup
	for i := range r.nodes {
		wg.Go(func() {
			r.nodes[i] = startNode(r.t, r.e, fmt.Sprintf("tight-%02d", i), []string{r.pool}, nodeOpts{} /* the pool's default reuse cooldown, 30 s */)
		})
	}
	wg.Wait()
}

func (r *tightRun) pod(i int) (*testNode, records.Owner) {
	return r.nodes[i%tightNodes], records.Owner{ContainerID: fmt.Sprintf("tight-%04d", i), IfName: "eth0"}
}

// each runs f for every pod at once and returns how long it took.
func (r *tightRun) each(f func(i int) error) time.Duration {
	start := time.Now()
	var mu sync.Mutex
	var wg sync.WaitGroup
	for i := range tightPods {
		wg.Go(func() {
			if err := f(i); err != nil {
				mu.Lock()
				r.failures = append(r.failures, err)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	return time.Since(start)
}

func (r *tightRun) create() time.Duration {
	return r.each(func(i int) error {
		n, o := r.pod(i)
		res, err := n.alloc.Allocate(context.Background(), nodealloc.Request{Pool: r.pool, Owner: o})
		if err != nil {
			return fmt.Errorf("pod %d on %s: %w", i, n.name, err)
		}
		r.held[i] = res.Allocations[0].Addr
		return nil
	})
}

func (r *tightRun) delete() time.Duration {
	return r.each(func(i int) error {
		n, o := r.pod(i)
		_, err := n.alloc.Release(context.Background(), o)
		return err
	})
}

// restart stops every node at once (their leases end) and starts them
// again, which restores each from etcd.
func (r *tightRun) restart() time.Duration {
	start := time.Now()
	for _, n := range r.nodes {
		_, err := n.cli.Revoke(context.Background(), clientv3.LeaseID(n.sess.ID()))
		require.NoError(r.t, err)
	}
	r.start()
	return time.Since(start)
}

// checkHeld checks that every pod holds a distinct address, in the cache
// of its node and in etcd.
func (r *tightRun) checkHeld() {
	t := r.t
	requireNoFailures(t, r.failures, "before the check")
	seen := map[netip.Addr]int{}
	for i, a := range r.held {
		require.True(t, a.IsValid(), "pod %d has no address", i)
		j, dup := seen[a]
		require.False(t, dup, "%s handed to pods %d and %d", a, j, i)
		seen[a] = i
		n, o := r.pod(i)
		got := n.alloc.Lookup(o)
		require.Len(t, got, 1, "pod %d on %s", i, n.name)
		require.Equal(t, a, got[0].Addr, "pod %d on %s", i, n.name)
	}
	inStore := storeIPs(t, r.nodes[0].cli, r.pool)
	require.Len(t, inStore, tightPods)
	for _, al := range inStore {
		i, ok := seen[al.Addr]
		require.True(t, ok, "%s in etcd but held by no pod", al.Addr)
		n, o := r.pod(i)
		require.Equal(t, o.Key(), al.Owner.Key())
		require.Equal(t, n.name, al.Node)
		require.False(t, al.Lease != 0, "%s is still a reservation", al.Addr)
	}
}

func TestTightPoolEveryPodGetsAddress(t *testing.T) {
	e := etcdtest.Start(t)
	r := newTightRun(t, e, tightPool("tight"))

	r.create()
	requireNoFailures(t, r.failures, "every pod gets an address while the pool has one")
	r.checkHeld()
	snap, err := r.nodes[0].store.PoolSnapshot(context.Background(), "tight")
	require.NoError(t, err)
	require.NotEmpty(t, snap.Lent, "10 nodes of 100 pods in 16 blocks of 64 must borrow")
	t.Logf("first create: %d of %d addresses borrowed across blocks", len(snap.Lent), tightPods)

	r.delete()
	requireNoFailures(t, r.failures, "delete")
	require.Empty(t, storeIPs(t, r.nodes[0].cli, "tight"))
	r.create()
	requireNoFailures(t, r.failures, "every pod gets an address again, cooldown or not")
	r.checkHeld()

	r.restart()
	r.checkHeld()

	r.delete()
	requireNoFailures(t, r.failures, "delete after restart")
	snap, err = r.nodes[0].store.PoolSnapshot(context.Background(), "tight")
	require.NoError(t, err)
	require.Empty(t, snap.Used, "no allocation left")
	require.Empty(t, snap.Lent, "no lent address's home left")
	resp, err := r.nodes[0].cli.Get(context.Background(), etcdstore.LentPrefix("tight"), clientv3.WithPrefix(), clientv3.WithCountOnly())
	require.NoError(t, err)
	require.Zero(t, resp.Count)
}

// requireNoFailures fails with the count and the first few failures.
func requireNoFailures(t testing.TB, errs []error, what string) {
	t.Helper()
	if len(errs) > 0 {
		t.Fatalf("%s: %d failures, the first: %v", what, len(errs), errs[:min(3, len(errs))])
	}
}

// BenchmarkTightPool runs the tight-pool scenario once (make bench runs it
// with -benchtime 1x) and reports each phase in seconds, beside the same
// phases on a roomy pool (a /20: every node gets blocks of its own) as
// the baseline measured in the same run.
func BenchmarkTightPool(b *testing.B) {
	e := etcdtest.Start(b)
	phases := func(p allocator.Pool) (map[string]float64, int) {
		r := newTightRun(b, e, p)
		out := map[string]float64{}
		out["create"] = r.create().Seconds()
		r.delete()
		out["recreate"] = r.create().Seconds()
		out["recovery"] = r.restart().Seconds()
		r.checkHeld()
		out["delete"] = r.delete().Seconds()
		return out, len(r.failures)
	}
	roomy := allocator.Pool{Name: "roomy", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.71.0.0/20")}, BlockSizeV4: 26}
	for b.Loop() {
		base, baseFail := phases(roomy)
		tight, fail := phases(tightPool("tight"))
		for _, ph := range []string{"create", "recreate", "recovery", "delete"} {
			b.ReportMetric(tight[ph], "tight1000."+ph+".seconds")
			b.ReportMetric(tight[ph]/base[ph], "tight1000."+ph+".vs-roomy")
		}
		b.ReportMetric(float64(fail+baseFail), "tight1000.failures")
	}
}
