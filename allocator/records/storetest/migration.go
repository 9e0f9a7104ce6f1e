package storetest

import (
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
)

// A live migration's three writes (records.Migrations): each rewrites
// the binding and every record of its addresses in one step, compared
// at the revisions read; a stale binding or record is a lost race that
// writes nothing.

// migrating is an identity bound on n1 to owner 1 with two confirmed
// addresses of blockA (n1's block), as a running VM holds them.
type migrating struct {
	b   records.Binding
	cur []records.Allocation
}

var (
	migA1 = addr("10.0.0.1")
	migA2 = addr("10.0.0.2")
)

func (f *fixture) migrating(t *testing.T) migrating {
	t.Helper()
	rev, _ := f.claim(t, "n1", blockA)
	bd := records.Binding{Pool: "p", Identity: identity, Addrs: []netip.Addr{migA1, migA2}, Owner: owner(1), Node: "n1",
		Since: f.Now().UTC().Truncate(time.Second), WindowSeconds: 60}
	rec := f.rec(1, "n1", records.StateAllocated)
	rec.Identity, rec.WindowSeconds = identity, 60
	_, err := f.Store.WriteBound(f.ctx, bd, []records.IPWrite{
		{Pool: "p", Block: blockA, ClaimRev: rev, Addr: migA1, Record: rec},
		{Pool: "p", Block: blockA, ClaimRev: rev, Addr: migA2, Record: rec}})
	require.NoError(t, err)
	f.NodeLive("n1", true)
	f.NodeLive("n2", true)
	return f.reread(t)
}

// reread reads the identity's binding and its records again.
func (f *fixture) reread(t *testing.T) migrating {
	t.Helper()
	b, ok, err := f.Store.GetBinding(f.ctx, "p", identity)
	require.NoError(t, err)
	require.True(t, ok)
	return migrating{b: b, cur: []records.Allocation{f.get(t, blockA, migA1, 0), f.get(t, blockA, migA2, 0)}}
}

// unchanged checks that the binding, the records and the lent homes are
// as m and lent say: a refused write wrote nothing.
func (f *fixture) unchanged(t *testing.T, m migrating, lent map[netip.Addr]string) {
	t.Helper()
	now := f.reread(t)
	require.Equal(t, m.b, now.b, "the binding")
	require.Equal(t, m.cur, now.cur, "the address records")
	got, err := f.Store.ListLent(f.ctx, "p")
	require.NoError(t, err)
	require.Equal(t, lent, got, "the lent homes")
}

// stale returns m with the binding's revision (which) or a record's one
// behind what the store holds.
func (m migrating) stale(which int) migrating {
	out := migrating{b: m.b, cur: append([]records.Allocation(nil), m.cur...)}
	if which < 0 {
		out.b.Rev--
	} else {
		out.cur[which].Rev--
	}
	return out
}

// alt is owner 2 on n2, the migration's target.
func (f *fixture) alt() records.Alternate {
	return records.Alternate{Owner: owner(2), Node: "n2", Since: f.Now().UTC().Truncate(time.Second), Migration: "job-1"}
}

// lastInterval is addr's newest ended interval in IP history.
func (f *fixture) lastInterval(t *testing.T, a netip.Addr) Interval {
	t.Helper()
	hs := f.History("p", a)
	require.NotEmpty(t, hs, "IP history of %s", a)
	return hs[len(hs)-1]
}

var migrationTests = []test{
	{"migration/admit", func(t *testing.T, f *fixture) {
		m := f.migrating(t)
		alt := f.alt()
		// A stale binding, or a stale record: a lost race, nothing written.
		for _, which := range []int{-1, 0, 1} {
			_, err := f.Store.Admit(f.ctx, m.stale(which).b, m.stale(which).cur, alt)
			require.ErrorIs(t, err, retry.ErrConflict, "stale %d", which)
			f.unchanged(t, m, map[netip.Addr]string{})
		}
		// A record missing: the pod holds part of the identity's
		// addresses; the target gets all or none.
		_, err := f.Store.Admit(f.ctx, m.b, m.cur[:1], alt)
		require.ErrorIs(t, err, records.ErrMigration)
		f.unchanged(t, m, map[netip.Addr]string{})
		// The target's node has no live record: refused, nothing written.
		f.NodeLive("n2", false)
		_, err = f.Store.Admit(f.ctx, m.b, m.cur, alt)
		require.Error(t, err)
		f.unchanged(t, m, map[netip.Addr]string{})
		f.NodeLive("n2", true)
		// From a fresh read: the binding and every record name the
		// alternate; the owner and its node stay.
		nb, err := f.Store.Admit(f.ctx, m.b, m.cur, alt)
		require.NoError(t, err)
		require.Greater(t, nb.Rev, m.b.Rev)
		now := f.reread(t)
		require.Equal(t, nb, now.b)
		want := m.b
		want.Alternate, want.Rev = &alt, nb.Rev
		require.Equal(t, want, now.b)
		for i, al := range now.cur {
			require.Equal(t, nb.Rev, al.Rev, "%s written with the binding", al.Addr)
			w := m.cur[i]
			w.Alternate, w.Rev = &alt, nb.Rev
			require.Equal(t, w, al)
		}
		// A second target, while the first is the alternate: refused.
		third := alt
		third.Owner = owner(3)
		_, err = f.Store.Admit(f.ctx, now.b, now.cur, third)
		require.ErrorIs(t, err, records.ErrMigration)
		f.unchanged(t, now, map[netip.Addr]string{})
	}},
	{"migration/admit-kept-refused", func(t *testing.T, f *fixture) {
		m := f.migrating(t)
		_, err := f.Store.Keep(f.ctx, m.b, m.cur)
		require.NoError(t, err)
		kept := f.reread(t)
		_, err = f.Store.Admit(f.ctx, kept.b, kept.cur, f.alt())
		require.ErrorIs(t, err, records.ErrMigration)
		f.unchanged(t, kept, map[netip.Addr]string{})
	}},
	{"migration/keep-clears-alternate", func(t *testing.T, f *fixture) {
		// A kept record has no alternate: no pod holds a kept address.
		m := f.migrating(t)
		_, err := f.Store.Admit(f.ctx, m.b, m.cur, f.alt())
		require.NoError(t, err)
		m = f.reread(t)
		_, err = f.Store.Keep(f.ctx, m.b, m.cur)
		require.NoError(t, err)
		kept := f.reread(t)
		require.True(t, kept.b.Kept())
		require.Nil(t, kept.b.Alternate)
		for _, al := range kept.cur {
			require.Equal(t, records.StateKept, al.State)
			require.Nil(t, al.Alternate, "%s kept with an alternate", al.Addr)
		}
	}},
	{"migration/cut-over", func(t *testing.T, f *fixture) {
		m := f.migrating(t)
		alt := f.alt()
		_, err := f.Store.Admit(f.ctx, m.b, m.cur, alt)
		require.NoError(t, err)
		m = f.reread(t)
		// No alternate: refused.
		_, err = f.Store.CutOver(f.ctx, records.Binding{Pool: "p", Identity: identity, Addrs: m.b.Addrs, Owner: m.b.Owner, Node: m.b.Node, Rev: m.b.Rev}, m.cur, true)
		require.ErrorIs(t, err, records.ErrMigration)
		for _, which := range []int{-1, 0, 1} {
			_, err := f.Store.CutOver(f.ctx, m.stale(which).b, m.stale(which).cur, true)
			require.ErrorIs(t, err, retry.ErrConflict, "stale %d", which)
			f.unchanged(t, m, map[netip.Addr]string{})
		}
		// The alternate's node has no live record: its pod cannot
		// forward.
		f.NodeLive("n2", false)
		_, err = f.Store.CutOver(f.ctx, m.b, m.cur, true)
		require.ErrorIs(t, err, records.ErrAlternateGone)
		f.unchanged(t, m, map[netip.Addr]string{})
		f.NodeLive("n2", true)
		// The alternate forwards: it owns the records on its node, which
		// the addresses route to (lent homes: the block is n1's); the
		// former owner is the alternate (keepOld); the interval of the
		// owner on n1 ends, migrated.
		nb, err := f.Store.CutOver(f.ctx, m.b, m.cur, true)
		require.NoError(t, err)
		now := f.reread(t)
		require.Equal(t, nb, now.b)
		require.Equal(t, owner(2), now.b.Owner)
		require.Equal(t, "n2", now.b.Node)
		require.NotNil(t, now.b.Alternate)
		require.Equal(t, owner(1), now.b.Alternate.Owner)
		require.Equal(t, "n1", now.b.Alternate.Node)
		require.Equal(t, m.b.Addrs, now.b.Addrs)
		for _, al := range now.cur {
			require.Equal(t, nb.Rev, al.Rev)
			require.Equal(t, owner(2), al.Owner)
			require.Equal(t, "n2", al.Node)
			require.Equal(t, records.StateAllocated, al.State)
			require.Equal(t, identity, al.Identity)
			require.True(t, al.Borrowed, "%s routes to n2, outside n2's blocks", al.Addr)
			require.Equal(t, now.b.Alternate.Owner, al.Alternate.Owner)
			require.Equal(t, "n1", al.Alternate.Node)
			require.Equal(t, Interval{Owner: owner(1), Node: "n1", Reason: "migrated"}, f.lastInterval(t, al.Addr))
		}
		lent, err := f.Store.ListLent(f.ctx, "p")
		require.NoError(t, err)
		require.Equal(t, map[netip.Addr]string{migA1: "n2", migA2: "n2"}, lent)
		// And back, the former owner gone from the alternate (keepOld
		// unset): to the block's home, whose addresses need no home of
		// their own.
		f.NodeLive("n1", true)
		back, err := f.Store.CutOver(f.ctx, now.b, now.cur, false)
		require.NoError(t, err)
		end := f.reread(t)
		require.Equal(t, back, end.b)
		require.Equal(t, owner(1), end.b.Owner)
		require.Equal(t, "n1", end.b.Node)
		require.Nil(t, end.b.Alternate)
		for _, al := range end.cur {
			require.Equal(t, owner(1), al.Owner)
			require.Equal(t, "n1", al.Node)
			require.False(t, al.Borrowed)
			require.Nil(t, al.Alternate)
			require.Equal(t, Interval{Owner: owner(2), Node: "n2", Reason: "migrated"}, f.lastInterval(t, al.Addr))
		}
		f.unchanged(t, end, map[netip.Addr]string{})
	}},
	{"migration/drop-alternate", func(t *testing.T, f *fixture) {
		m := f.migrating(t)
		// No alternate: nothing to do, nothing written.
		got, err := f.Store.DropAlternate(f.ctx, m.b, m.cur)
		require.NoError(t, err)
		require.Equal(t, m.b, got)
		f.unchanged(t, m, map[netip.Addr]string{})
		_, err = f.Store.Admit(f.ctx, m.b, m.cur, f.alt())
		require.NoError(t, err)
		m = f.reread(t)
		for _, which := range []int{-1, 0, 1} {
			_, err := f.Store.DropAlternate(f.ctx, m.stale(which).b, m.stale(which).cur)
			require.ErrorIs(t, err, retry.ErrConflict, "stale %d", which)
			f.unchanged(t, m, map[netip.Addr]string{})
		}
		// The target's DEL before the cut-over: the owner forwards on;
		// the second owner's interval ends in IP history.
		nb, err := f.Store.DropAlternate(f.ctx, m.b, m.cur)
		require.NoError(t, err)
		now := f.reread(t)
		require.Equal(t, nb, now.b)
		want := m.b
		want.Alternate, want.Rev = nil, nb.Rev
		require.Equal(t, want, now.b)
		for i, al := range now.cur {
			w := m.cur[i]
			w.Alternate, w.Rev = nil, nb.Rev
			require.Equal(t, w, al)
			require.Equal(t, Interval{Owner: owner(2), Node: "n2", Reason: "alternate-ended"}, f.lastInterval(t, al.Addr))
		}
		f.unchanged(t, now, map[netip.Addr]string{})
	}},
}
