// Package storetest is the conformance suite of records.Store: one set
// of behaviour tests that every implementation passes, run against
// etcdstore on a real (embedded) etcd and against the in-memory store
// (allocator/records/memstore). The suite is the contract: a difference
// between the two stores is a failing test, so a test written on the
// in-memory store says what etcd would say.
//
// It covers every method of every role of records.Store: the fences of
// each write, what each failed compare reports, the revisions and leases
// each write leaves, and what the end of a lease takes with it.
package storetest

import (
	"context"
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
)

// Harness is one fresh, empty store and the hooks the suite needs around
// it. Each test gets its own.
type Harness struct {
	Store records.Store
	// Grant grants a lease of ttl (a node's session lease) and returns
	// its ID.
	Grant func(ttl time.Duration) int64
	// Revoke ends a lease now, and every key on it, as its expiry would.
	Revoke func(lease int64)
	// Now is the store's clock: what it stamps records with and counts
	// leases by.
	Now func() time.Time
	// NodeLive gives node a live record (its agent runs) or takes it
	// away: a live migration's admit and cut-over to a node need one.
	NodeLive func(node string, live bool)
	// Importer is Store's import role (records.Importer).
	Importer records.Importer
	// NodeOn gives node a live record on lease, as its agent's start
	// writes it: an import for node compares it.
	NodeOn func(node string, lease int64)
	// History reads the ended intervals of addr in pool (IP history),
	// oldest end first.
	History func(pool string, addr netip.Addr) []Interval
}

// Interval is one ended interval of an address in IP history.
type Interval struct {
	Owner  records.Owner
	Node   string
	Reason string
}

// tolerance is how far the suite lets a time the store reports be from
// the one it expects: etcd counts lease TTLs in whole seconds, on its
// own clock.
const tolerance = 2 * time.Second

// test is one behaviour of the contract.
type test struct {
	name string
	run  func(t *testing.T, f *fixture)
}

// Run runs the suite, each test on a store newStore makes for it.
func Run(t *testing.T, newStore func(t *testing.T) Harness) {
	var all []test
	all = append(all, poolTests...)
	all = append(all, claimTests...)
	all = append(all, ipTests...)
	all = append(all, loanTests...)
	all = append(all, bindingTests...)
	all = append(all, migrationTests...)
	all = append(all, edgeTests...)
	all = append(all, txnSizeTests...)
	all = append(all, moreEdgeTests...)
	all = append(all, raceTests...)
	all = append(all, zeroTests...)
	all = append(all, importTests...)
	for _, tc := range all {
		t.Run(tc.name, func(t *testing.T) {
			tc.run(t, newFixture(t, newStore(t)))
		})
	}
}

// fixture is a store with one pool, "p": 10.0.0.0/24 in /28 blocks.
type fixture struct {
	Harness
	ctx  context.Context
	pool allocator.Pool
}

// The fixture's blocks.
var (
	blockA = netip.MustParsePrefix("10.0.0.0/28")
	blockB = netip.MustParsePrefix("10.0.0.16/28")
	blockC = netip.MustParsePrefix("10.0.0.32/28")
)

func newFixture(t *testing.T, h Harness) *fixture {
	t.Helper()
	f := &fixture{Harness: h, ctx: context.Background()}
	p, err := h.Store.EnsurePool(f.ctx, testPool("p", "10.0.0.0/24"))
	require.NoError(t, err)
	f.pool = p
	return f
}

func testPool(name, cidr string) allocator.Pool {
	return allocator.Pool{Name: name, CIDRs: []netip.Prefix{netip.MustParsePrefix(cidr)}, BlockSizeV4: 28}
}

func addr(s string) netip.Addr { return netip.MustParseAddr(s) }

func owner(i int) records.Owner {
	return records.Owner{ContainerID: fmt.Sprintf("ctr-%04d", i), IfName: "eth0", Namespace: "default", Pod: fmt.Sprintf("pod-%d", i)}
}

// claim is node's claim on b, granted a lease of its own.
func (f *fixture) claim(t *testing.T, node string, b netip.Prefix) (rev, lease int64) {
	t.Helper()
	lease = f.Grant(time.Minute)
	res, err := f.Store.Claim(f.ctx, f.pool.Name, b, records.Claim{Node: node, ClaimedAt: f.Now()}, lease)
	require.NoError(t, err)
	require.Positive(t, res.Rev)
	return res.Rev, lease
}

// rec is an allocated record of owner i on node.
func (f *fixture) rec(i int, node string, st records.State) records.Record {
	return records.Record{Owner: owner(i), Node: node, State: st, Since: f.Now().UTC().Truncate(time.Second)}
}

// write writes one allocation, fenced by claimRev, and returns it as the
// store holds it.
func (f *fixture) write(t *testing.T, b netip.Prefix, claimRev int64, a netip.Addr, r records.Record, reserve bool) records.Allocation {
	t.Helper()
	res, err := f.Store.WriteIPs(f.ctx, []records.IPWrite{{Pool: f.pool.Name, Block: b, ClaimRev: claimRev, Addr: a, Record: r, Reserve: reserve}})
	require.NoError(t, err)
	return f.get(t, b, a, res.Rev)
}

// get reads one allocation, which must exist at rev (0: any).
func (f *fixture) get(t *testing.T, b netip.Prefix, a netip.Addr, rev int64) records.Allocation {
	t.Helper()
	got, err := f.Store.GetIPs(f.ctx, []records.IPRef{{Pool: f.pool.Name, Block: b, Addr: a}})
	require.NoError(t, err)
	al, ok := got[a]
	require.True(t, ok, "allocation %s", a)
	if rev != 0 {
		require.Equal(t, rev, al.Rev)
	}
	return al
}

// absent checks that a has no allocation.
func (f *fixture) absent(t *testing.T, b netip.Prefix, a netip.Addr) {
	t.Helper()
	got, err := f.Store.GetIPs(f.ctx, []records.IPRef{{Pool: f.pool.Name, Block: b, Addr: a}})
	require.NoError(t, err)
	require.NotContains(t, got, a)
}

// block reads one block's claim and home.
func (f *fixture) block(t *testing.T, b netip.Prefix) (records.BlockInfo, bool) {
	t.Helper()
	got, err := f.Store.GetBlocks(f.ctx, f.pool.Name, []netip.Prefix{b})
	require.NoError(t, err)
	bi, ok := got[b]
	return bi, ok
}

// near checks that got is want, give or take the tolerance.
func near(t *testing.T, want, got time.Time, what string) {
	t.Helper()
	require.WithinDuration(t, want, got, tolerance, what)
}

func netipPrefix(s string) netip.Prefix { return netip.MustParsePrefix(s) }
