package nodealloc_test

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
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

var (
	modelSteps = flag.Int("model.steps", 120, "steps per caller of TestModelNodeAllocator (make test runs it briefly; raise it for a long run)")
	modelSeed  = flag.Uint64("model.seed", 0, "seed of TestModelNodeAllocator's choices and faults; 0 picks one and logs it")
)

// faultPlan is how often the model test injects each fault, per store call.
type faultPlan struct {
	failBefore float64 // the call fails without reaching etcd
	unknown    float64 // a write commits, then the caller is told it failed
	conflict   float64 // a write is refused as a lost race without reaching etcd
	revoke     float64 // the node's lease is revoked before the call
}

// faults decides, from one seeded source, which store call fails how.
type faults struct {
	mu   sync.Mutex
	rng  *rand.Rand
	plan faultPlan
	n    map[string]int // injected, by kind
}

func (f *faults) roll(p float64, kind string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.rng.Float64() >= p {
		return false
	}
	f.n[kind]++
	return true
}

// modelNode is a node allocator whose store injects faults, and what its
// agent would do on a lost lease: take a new one and Restore.
type modelNode struct {
	name  string
	cli   *clientv3.Client
	store *etcdstore.Store
	alloc *nodealloc.Allocator
	mu    sync.Mutex // serializes recover
	sess  atomic.Pointer[kvstore.Session]
}

// session is read by fault hooks that run inside recover's Restore, so it
// is not guarded by mu.
func (n *modelNode) session() *kvstore.Session { return n.sess.Load() }

// recover renews a lost lease and restores, as the agent's lease keeper
// does; a failure (an injected one included) is left for the next caller.
func (n *modelNode) recover(ctx context.Context) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if s := n.session(); s != nil && !s.Lost() {
		if err := n.alloc.Restore(ctx, s); err == nil {
			return
		}
	}
	if s := n.session(); s != nil {
		s.Close()
	}
	sess, err := kvstore.NewSession(ctx, n.cli, 30)
	if err != nil {
		n.sess.Store(nil)
		return
	}
	n.sess.Store(sess)
	_ = n.alloc.Restore(ctx, sess)
}

// model is what callers were told: which owner holds which address.
type model struct {
	mu     sync.Mutex
	holder map[netip.Addr]string // address -> owner told it, not since released
	// unsure owners had an operation fail: etcd may hold more or less for
	// them than they were told, until their next success.
	unsure map[string]bool
}

// TestModelNodeAllocator drives several node allocators with concurrent
// callers through random allocations (reservations, permanent, static,
// batches), confirms and releases, while the store injects lost races,
// failures, writes of unknown outcome, reload failures and lease
// revocations at random points. After every step it checks the caller's
// answer against a model of what every caller was told, and etcd against
// both: no address with two live owners, no owner with two addresses of a
// family, and every owner's addresses in etcd exactly as it was last told.
//
// Run longer with: go test ./allocator -run TestModelNodeAllocator -model.steps=5000
func TestModelNodeAllocator(t *testing.T) {
	seed := *modelSeed
	if seed == 0 {
		seed = uint64(time.Now().UnixNano())
	}
	t.Logf("seed %d (replay the choices with -model.seed=%d; goroutine timing still varies)", seed, seed)
	const nodes, callers, ownersPerCaller = 3, 3, 4
	pool := allocator.Pool{Name: "model", BlockSizeV4: 29, BlockSizeV6: 125,
		// 30 and 31 usable addresses for 36 owners: the pool fills, and
		// nodes borrow across blocks.
		CIDRs: []netip.Prefix{netip.MustParsePrefix("10.90.0.0/27"), netip.MustParsePrefix("fd00:90::/123")}}
	e := startEtcd(t, pool)
	check := etcdtest.Client(t, e) // the test's own view of etcd, without faults
	ctx := context.Background()

	f := &faults{rng: rand.New(rand.NewPCG(seed, 1)), n: map[string]int{},
		plan: faultPlan{failBefore: 0.02, unknown: 0.05, conflict: 0.02, revoke: 0.004}}
	var borrows atomic.Int64 // borrowed writes sent
	ns := make([]*modelNode, nodes)
	for i := range ns {
		n := &modelNode{name: fmt.Sprintf("node-%d", i), cli: etcdtest.Client(t, e)}
		n.store = etcdstore.New(n.cli, etcdstore.Options{ReservationTTL: time.Hour})
		h := newHookStore(n.store)
		for _, op := range []string{"ListBlocks", "Claim", "Reclaim", "Unclaim", "ListIPs", "GetIPs", "WriteIPs", "LeaseExpiry", "DeleteIP", "PoolSnapshot", "FenceBorrower"} {
			h.Before(op, func(ctx context.Context) error {
				if f.roll(f.plan.revoke, "revoke") {
					if s := n.session(); s != nil {
						_, _ = check.Revoke(ctx, clientv3.LeaseID(s.ID()))
					}
				}
				if op == "WriteIPs" && f.roll(f.plan.conflict, "conflict") {
					return fmt.Errorf("injected lost race: %w", records.ErrConflict)
				}
				if f.roll(f.plan.failBefore, "fail:"+op) {
					return errInjected
				}
				return nil
			})
			if op == "WriteIPs" || op == "DeleteIP" || op == "Claim" || op == "Reclaim" || op == "Unclaim" || op == "FenceBorrower" {
				h.After(op, func(_ context.Context, err error) error {
					if err == nil && f.roll(f.plan.unknown, "unknown:"+op) {
						return errUnknown
					}
					return err
				})
			}
		}
		al, err := nodealloc.New(nodealloc.Config{Node: n.name, Store: writeHook{Store: h, onWrite: func(ws []records.IPWrite) {
			for _, w := range ws {
				if w.Borrowed {
					borrows.Add(1)
				}
			}
		}}})
		require.NoError(t, err)
		n.alloc = al
		n.recover(ctx)
		ns[i] = n
	}

	m := &model{holder: map[netip.Addr]string{}, unsure: map[string]bool{}}
	var failed sync.Once
	fail := func(format string, args ...any) {
		failed.Do(func() { t.Errorf("seed %d: "+format, append([]any{seed}, args...)...) })
	}
	var wg sync.WaitGroup
	for c := range nodes * callers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			n := ns[c%nodes]
			rng := rand.New(rand.NewPCG(seed, uint64(c)+2))
			var owners []records.Owner
			for i := range ownersPerCaller {
				owners = append(owners, records.Owner{ContainerID: fmt.Sprintf("c%d-o%d", c, i), IfName: "eth0"})
			}
			told := map[string][]netip.Addr{} // this caller's owners, as last told
			for step := 0; step < *modelSteps && !t.Failed(); step++ {
				o := owners[rng.IntN(len(owners))]
				k := o.Key()
				var err error
				switch op := rng.IntN(100); {
				case op < 35:
					var r nodealloc.Result
					r, err = n.alloc.Allocate(ctx, nodealloc.Request{Pool: pool.Name, Owner: o, Reserve: rng.IntN(2) == 0})
					if err == nil {
						m.tell(fail, o, r.Allocations, told)
					}
				case op < 45:
					// A batch of this caller's owners, as the agent's group commit sends.
					var reqs []nodealloc.Request
					for _, bo := range owners[:2+rng.IntN(len(owners)-1)] {
						reqs = append(reqs, nodealloc.Request{Pool: pool.Name, Owner: bo, Reserve: true})
					}
					for i, oc := range n.alloc.AllocateBatch(ctx, reqs) {
						if oc.Err == nil {
							m.tell(fail, reqs[i].Owner, oc.Result.Allocations, told)
						} else if !refusal(oc.Err) {
							m.doubt(reqs[i].Owner)
						}
						m.verifyOwner(ctx, fail, check, pool.Name, reqs[i].Owner, told)
					}
				case op < 52:
					if len(told[k]) > 0 || m.isUnsure(k) {
						continue
					}
					// A static address anywhere in the pool: taken ones must be refused.
					cidr := pool.CIDRs[rng.IntN(len(pool.CIDRs))]
					addr := cidr.Addr()
					for range rng.IntN(64) {
						addr = addr.Next()
					}
					var r nodealloc.Result
					r, err = n.alloc.Allocate(ctx, nodealloc.Request{Pool: pool.Name, Owner: o, IPs: []netip.Addr{addr}})
					if err == nil {
						m.tell(fail, o, r.Allocations, told)
					}
				case op < 67:
					var done []records.Allocation
					done, err = n.alloc.Confirm(ctx, o)
					switch {
					case errors.Is(err, records.ErrNotFound):
						if len(told[k]) > 0 && !m.isUnsure(k) {
							fail("confirm of %s found nothing, but it was told %v", k, told[k])
						}
						err = nil // nothing to confirm is a fine answer
					case err == nil:
						// Confirm answers the owner's whole holding, now permanent.
						held := map[netip.Addr]records.Allocation{}
						for _, al := range storeIPs(t, check, pool.Name) {
							if al.Owner.Key() == k {
								held[al.Addr] = al
							}
						}
						for _, al := range done {
							if held[al.Addr].State != records.StateAllocated {
								fail("confirm of %s answered %s but it is %q in etcd", k, al.Addr, held[al.Addr].State)
							}
						}
						m.tell(fail, o, done, told)
					}
				default:
					m.doubt(o) // its addresses may be free from now on
					_, err = n.alloc.Release(ctx, o)
					if err == nil {
						m.released(o, told)
					}
				}
				if err != nil && !refusal(err) {
					m.doubt(o)
				}
				if err != nil {
					if errors.Is(err, records.ErrLeaseLost) || errors.Is(err, records.ErrUnavailable) {
						n.recover(ctx)
					}
				}
				m.verifyOwner(ctx, fail, check, pool.Name, o, told)
				m.verifyStore(ctx, fail, check, pool.Name)
			}
		}()
	}
	wg.Wait()
	t.Logf("faults injected: %v", f.n)
	require.False(t, t.Failed())
	require.NotZero(t, f.n["unknown:WriteIPs"], "the run must meet writes of unknown outcome")
	require.NotZero(t, borrows.Load(), "and borrowing across blocks")
	t.Logf("borrowed writes: %d", borrows.Load())
	require.NotZero(t, f.n["revoke"]+f.n["fail:LeaseExpiry"]+f.n["fail:ListIPs"], "and lease or reload faults")
}

// refusal reports whether err is a definite refusal, after which the store
// holds for the owner exactly what it held before.
func refusal(err error) bool {
	for _, e := range []error{records.ErrBadRequest, records.ErrIPInUse, records.ErrNotOwned, records.ErrExhausted, records.ErrNotFound} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// tell records that o was told als (its whole holding in the pool, one
// address per family), checking it against everyone else's.
func (m *model) tell(fail func(string, ...any), o records.Owner, als []records.Allocation, told map[string][]netip.Addr) {
	m.mu.Lock()
	defer m.mu.Unlock()
	k := o.Key()
	fams := map[allocator.Family]netip.Addr{}
	var got []netip.Addr
	for _, al := range als {
		f := allocator.FamilyOf(al.Addr)
		if prev, dup := fams[f]; dup {
			fail("%s was told two %s addresses at once: %s and %s", k, f, prev, al.Addr)
		}
		fams[f] = al.Addr
		got = append(got, al.Addr)
		if h := m.holder[al.Addr]; h != "" && h != k && !m.unsure[h] {
			fail("%s handed to %s while %s holds it", al.Addr, k, h)
		}
	}
	if !m.unsure[k] {
		for _, prev := range told[k] {
			if a, ok := fams[allocator.FamilyOf(prev)]; ok && a != prev {
				fail("%s held %s and a retry gave it %s", k, prev, a)
			}
		}
	}
	for _, prev := range told[k] {
		if !slices.Contains(got, prev) {
			if _, same := fams[allocator.FamilyOf(prev)]; same || m.unsure[k] {
				delete(m.holder, prev)
				continue
			}
			got = append(got, prev) // a family not in this answer is still held
		}
	}
	for _, a := range got {
		m.holder[a] = k
	}
	told[k] = got
	delete(m.unsure, k)
}

func (m *model) doubt(o records.Owner) {
	m.mu.Lock()
	m.unsure[o.Key()] = true
	m.mu.Unlock()
}

func (m *model) isUnsure(k string) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.unsure[k]
}

func (m *model) released(o records.Owner, told map[string][]netip.Addr) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, a := range told[o.Key()] {
		if m.holder[a] == o.Key() {
			delete(m.holder, a)
		}
	}
	told[o.Key()] = nil
	delete(m.unsure, o.Key())
}

// verifyOwner checks that etcd holds exactly what o was last told, unless
// o is unsure (its last operation failed).
func (m *model) verifyOwner(ctx context.Context, fail func(string, ...any), cli *clientv3.Client, pool string, o records.Owner, told map[string][]netip.Addr) {
	if m.isUnsure(o.Key()) {
		return
	}
	als, ok := readPool(ctx, fail, cli, pool)
	if !ok {
		return
	}
	var held []netip.Addr
	for _, al := range als {
		if al.Owner.Key() == o.Key() {
			held = append(held, al.Addr)
		}
	}
	want := slices.Clone(told[o.Key()])
	slices.SortFunc(held, netip.Addr.Compare)
	slices.SortFunc(want, netip.Addr.Compare)
	if !slices.Equal(held, want) {
		fail("%s was told %v but etcd holds %v for it", o.Key(), want, held)
	}
}

// verifyStore checks etcd as a whole: no owner holds two addresses of a
// family (one key per address makes two owners of one address impossible
// in etcd itself; the model checks what callers were told).
func (m *model) verifyStore(ctx context.Context, fail func(string, ...any), cli *clientv3.Client, pool string) {
	als, ok := readPool(ctx, fail, cli, pool)
	if !ok {
		return
	}
	seen := map[string]netip.Addr{}
	for _, al := range als {
		k := al.Owner.Key() + "/" + allocator.FamilyOf(al.Addr).String()
		if prev, dup := seen[k]; dup {
			fail("etcd holds two %s addresses for %s: %s and %s", allocator.FamilyOf(al.Addr), al.Owner.Key(), prev, al.Addr)
		}
		seen[k] = al.Addr
	}
}

// readPool reads every allocation of pool from etcd.
func readPool(ctx context.Context, fail func(string, ...any), cli *clientv3.Client, pool string) ([]records.Allocation, bool) {
	resp, err := cli.Get(ctx, etcdstore.IPsPrefix(pool), clientv3.WithPrefix())
	if err != nil {
		fail("read etcd: %v", err)
		return nil, false
	}
	als, err := etcdstore.DecodeAllocations(pool, resp.Kvs)
	if err != nil {
		fail("decode etcd: %v", err)
		return nil, false
	}
	return als, true
}
