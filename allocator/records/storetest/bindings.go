package storetest

import (
	"errors"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
)

const identity = "default/web-0"

// bind writes a new binding of identity for owner i on node, with its
// reservation of a in block b (fenced by claimRev), and returns both as
// stored.
func (f *fixture) bind(t *testing.T, i int, node string, b netip.Prefix, claimRev int64, a netip.Addr) (records.Binding, records.Allocation) {
	t.Helper()
	bd := records.Binding{Pool: "p", Identity: identity, Addrs: []netip.Addr{a}, Owner: owner(i), Node: node, Since: f.Now().UTC().Truncate(time.Second), WindowSeconds: 60}
	rec := f.rec(i, node, records.StateReserved)
	rec.Identity, rec.WindowSeconds = identity, 60
	w := []records.IPWrite{{Pool: "p", Block: b, ClaimRev: claimRev, Addr: a, Record: rec, Reserve: true}}
	res, err := f.Store.WriteBound(f.ctx, bd, w)
	if errors.Is(err, retry.ErrConflict) {
		// The reservation lease ended (a test revoked it): the retry
		// is put on a new one.
		res, err = f.Store.WriteBound(f.ctx, bd, w)
	}
	require.NoError(t, err)
	got, ok, err := f.Store.GetBinding(f.ctx, "p", identity)
	require.NoError(t, err)
	require.True(t, ok)
	want := bd
	want.Rev = res.Rev
	require.Equal(t, want, got)
	return got, f.get(t, b, a, res.Rev)
}

var bindingTests = []test{
	{"bindings/write-bound-get-list", func(t *testing.T, f *fixture) {
		_, ok, err := f.Store.GetBinding(f.ctx, "p", identity)
		require.NoError(t, err)
		require.False(t, ok)
		rev, _ := f.claim(t, "n1", blockA)
		a := netip.MustParseAddr("10.0.0.1")
		bd, al := f.bind(t, 1, "n1", blockA, rev, a)
		require.NotZero(t, al.Lease)
		require.Zero(t, bd.Lease, "a pod holds the binding: no lease")
		// A second new binding of the identity lost the race, and writes nothing.
		_, err = f.Store.WriteBound(f.ctx, records.Binding{Pool: "p", Identity: identity, Owner: owner(2)}, []records.IPWrite{
			{Pool: "p", Block: blockA, ClaimRev: rev, Addr: netip.MustParseAddr("10.0.0.2"), Record: f.rec(2, "n1", records.StateReserved)}})
		require.ErrorIs(t, err, retry.ErrConflict)
		var we *records.WriteError
		require.False(t, errors.As(err, &we), "the binding, not a write, failed: %v", err)
		f.absent(t, blockA, netip.MustParseAddr("10.0.0.2"))
		// A binding at its revision, with a write that fails: a WriteError.
		_, err = f.Store.WriteBound(f.ctx, bd, []records.IPWrite{{Pool: "p", Block: blockA, ClaimRev: rev, Addr: a, Record: f.rec(2, "n1", records.StateReserved)}})
		require.ErrorAs(t, err, &we)
		require.Equal(t, []netip.Addr{a}, we.Taken)
		// The binding alone, rewritten at its revision.
		bd2 := bd
		bd2.Node = "n9"
		res, err := f.Store.WriteBound(f.ctx, bd2, nil)
		require.NoError(t, err)
		require.Greater(t, res.Rev, bd.Rev)
		other := records.Binding{Pool: "p", Identity: "default/web-1", Owner: owner(3)}
		res2, err := f.Store.WriteBound(f.ctx, other, nil)
		require.NoError(t, err)
		list, err := f.Store.ListBindings(f.ctx, "p")
		require.NoError(t, err)
		bd2.Rev = res.Rev
		other.Rev = res2.Rev
		require.Equal(t, []records.Binding{bd2, other}, list)
		all, err := f.Store.ListBindings(f.ctx, "")
		require.NoError(t, err)
		require.Equal(t, list, all)
		none, err := f.Store.ListBindings(f.ctx, "q")
		require.NoError(t, err)
		require.Empty(t, none)
	}},
	{"bindings/keep-and-take-over", func(t *testing.T, f *fixture) {
		rev, _ := f.claim(t, "n1", blockA)
		a := netip.MustParseAddr("10.0.0.1")
		bd, al := f.bind(t, 1, "n1", blockA, rev, a)
		// The pod's ADD finished: its reservation confirmed.
		conf := al.Record
		conf.State = records.StateAllocated
		res, err := f.Store.WriteIPs(f.ctx, []records.IPWrite{{Pool: "p", Block: blockA, ClaimRev: rev, Addr: a, Record: conf, PrevRev: al.Rev}})
		require.NoError(t, err)
		al = f.get(t, blockA, a, res.Rev)
		// A stale allocation or binding: nothing kept.
		stale := al
		stale.Rev--
		_, err = f.Store.Keep(f.ctx, bd, []records.Allocation{stale})
		require.ErrorIs(t, err, retry.ErrConflict)
		require.Equal(t, res.Rev, f.get(t, blockA, a, 0).Rev)
		staleB := bd
		staleB.Rev--
		_, err = f.Store.Keep(f.ctx, staleB, []records.Allocation{al})
		require.ErrorIs(t, err, retry.ErrConflict)
		// The pod's DEL keeps its address for the identity.
		before := f.Now()
		end, err := f.Store.Keep(f.ctx, bd, []records.Allocation{al})
		require.NoError(t, err)
		near(t, before.Add(time.Minute), end, "kept for the window")
		kept := f.get(t, blockA, a, 0)
		require.NotZero(t, kept.Lease)
		require.Equal(t, records.StateKept, kept.State)
		require.Equal(t, identity, kept.Identity)
		require.Equal(t, records.Owner{Namespace: "default", Pod: "pod-1"}, kept.Owner)
		require.Equal(t, "n1", kept.Node)
		near(t, before, kept.Since, "kept since")
		kb, ok, err := f.Store.GetBinding(f.ctx, "p", identity)
		require.NoError(t, err)
		require.True(t, ok)
		require.True(t, kb.Kept())
		require.Empty(t, kb.Node)
		require.Equal(t, kept.Lease, kb.Lease)
		require.Equal(t, kept.Rev, kb.Rev)
		exp, err := f.Store.LeaseExpiry(f.ctx, kb.Lease)
		require.NoError(t, err)
		near(t, end, exp, "the window's lease")
		last, err := f.Store.LastReleased(f.ctx, "p", []netip.Addr{a})
		require.NoError(t, err)
		near(t, before, last[a], "the pod's interval ended when kept")
		// The identity's next pod takes it over.
		next := kb
		next.Owner, next.Node = owner(2), "n1"
		rec := f.rec(2, "n1", records.StateReserved)
		rec.Identity = identity
		res, err = f.Store.WriteBound(f.ctx, next, []records.IPWrite{{Pool: "p", Block: blockA, ClaimRev: rev, Addr: a, Record: rec, PrevRev: kept.Rev}})
		require.NoError(t, err)
		took := f.get(t, blockA, a, res.Rev)
		require.Zero(t, took.Lease, "taken over: no longer on the window's lease")
		require.Equal(t, owner(2), took.Owner)
		nb, _, err := f.Store.GetBinding(f.ctx, "p", identity)
		require.NoError(t, err)
		require.Zero(t, nb.Lease)
		require.Equal(t, res.Rev, nb.Rev)
		f.Revoke(kb.Lease)
		f.get(t, blockA, a, res.Rev)
	}},
	{"bindings/kept-lapses", func(t *testing.T, f *fixture) {
		rev, _ := f.claim(t, "n1", blockA)
		a := netip.MustParseAddr("10.0.0.1")
		bd, al := f.bind(t, 1, "n1", blockA, rev, a)
		_, err := f.Store.Keep(f.ctx, bd, []records.Allocation{al})
		require.NoError(t, err)
		kb, _, err := f.Store.GetBinding(f.ctx, "p", identity)
		require.NoError(t, err)
		f.Revoke(kb.Lease)
		f.absent(t, blockA, a)
		_, ok, err := f.Store.GetBinding(f.ctx, "p", identity)
		require.NoError(t, err)
		require.False(t, ok, "the binding lapses with its addresses")
	}},
	{"bindings/take-over-ends", func(t *testing.T, f *fixture) {
		// A pod whose DEL never came: the next pod takes its allocation
		// over, and its interval ends then.
		rev, _ := f.claim(t, "n1", blockA)
		a := netip.MustParseAddr("10.0.0.1")
		bd, al := f.bind(t, 1, "n1", blockA, rev, a)
		next := bd
		next.Owner = owner(2)
		rec := f.rec(2, "n1", records.StateReserved)
		rec.Identity = identity
		before := f.Now()
		_, err := f.Store.WriteBound(f.ctx, next, []records.IPWrite{{Pool: "p", Block: blockA, ClaimRev: rev, Addr: a, Record: rec, PrevRev: al.Rev, Ends: &al}})
		require.NoError(t, err)
		last, err := f.Store.LastReleased(f.ctx, "p", []netip.Addr{a})
		require.NoError(t, err)
		near(t, before, last[a], "taken over now")
	}},
	{"bindings/release-drops-binding", func(t *testing.T, f *fixture) {
		// A sticky reservation released (its ADD failed) takes the
		// binding that names its owner.
		rev, _ := f.claim(t, "n1", blockA)
		a := netip.MustParseAddr("10.0.0.1")
		_, al := f.bind(t, 1, "n1", blockA, rev, a)
		require.NoError(t, f.Store.DeleteIP(f.ctx, al))
		_, ok, err := f.Store.GetBinding(f.ctx, "p", identity)
		require.NoError(t, err)
		require.False(t, ok)
		// Its reservation lapsed before the release: the binding goes alone.
		_, al = f.bind(t, 2, "n1", blockA, rev, a)
		f.Revoke(al.Lease)
		require.NoError(t, f.Store.DeleteIP(f.ctx, al))
		_, ok, err = f.Store.GetBinding(f.ctx, "p", identity)
		require.NoError(t, err)
		require.False(t, ok)
		// A binding naming another owner stays.
		bd, al := f.bind(t, 3, "n1", blockA, rev, a)
		mine := al
		mine.Owner = owner(4)
		f.Revoke(al.Lease)
		require.NoError(t, f.Store.DeleteIP(f.ctx, mine))
		got, ok, err := f.Store.GetBinding(f.ctx, "p", identity)
		require.NoError(t, err)
		require.True(t, ok)
		require.Equal(t, bd.Rev, got.Rev)
	}},
	{"bindings/drop-stale", func(t *testing.T, f *fixture) {
		rev, _ := f.claim(t, "n1", blockA)
		a := netip.MustParseAddr("10.0.0.1")
		bd, al := f.bind(t, 1, "n1", blockA, rev, a)
		refs := []records.IPRef{{Pool: "p", Block: blockA, Addr: a}}
		// The address is not as cur shows it (absent).
		require.ErrorIs(t, f.Store.DropStaleBinding(f.ctx, bd, refs, nil), retry.ErrConflict)
		stale := bd
		stale.Rev--
		cur := map[netip.Addr]records.Allocation{a: al}
		require.ErrorIs(t, f.Store.DropStaleBinding(f.ctx, stale, refs, cur), retry.ErrConflict)
		_, ok, err := f.Store.GetBinding(f.ctx, "p", identity)
		require.NoError(t, err)
		require.True(t, ok)
		require.NoError(t, f.Store.DropStaleBinding(f.ctx, bd, refs, cur))
		_, ok, err = f.Store.GetBinding(f.ctx, "p", identity)
		require.NoError(t, err)
		require.False(t, ok)
		f.get(t, blockA, a, al.Rev) // the address stays
	}},
}
