package planner

import (
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
)

// The folds: what the store's answers do to the cache, table-driven with
// no store. Each case builds a cache, folds one answer, and checks who
// the cache says holds an address, whether the address is taken in its
// bitmap, and what the planner decides next.

func TestPlannerFolds(t *testing.T) {
	blk := netip.MustParsePrefix("10.0.0.0/30")
	a1 := netip.MustParseAddr("10.0.0.1")
	ref := records.IPRef{Pool: "p", Block: blk, Addr: a1}
	cases := []struct {
		name  string
		setup func(w *world)
		fold  func(w *world)
		// holder is who the cache says holds a1 ("" nobody); taken
		// whether a1 is marked in its block.
		holder string
		taken  bool
		check  func(t *testing.T, w *world)
	}{{
		name:  "a write of unknown outcome that landed is the owner's",
		setup: func(w *world) { w.own(blk.String(), 5); w.n.Park(w.ps, owner("a").Key(), "write", ref) },
		fold: func(w *world) {
			w.n.ReadBack([]records.IPRef{ref}, map[netip.Addr]records.Allocation{a1: {Record: records.Record{Owner: owner("a"), Node: "node-a", State: records.StateAllocated}, Pool: "p", Block: blk, Addr: a1, Rev: 9}}, nil)
		},
		holder: owner("a").Key(), taken: true,
		check: func(t *testing.T, w *world) { require.Empty(t, w.n.Parked(), "settled") },
	}, {
		name: "a write of unknown outcome that did not land frees its address",
		setup: func(w *world) {
			w.own(blk.String(), 5)
			w.ps.own[blk].ba.Mark(a1)
			w.n.Park(w.ps, owner("a").Key(), "write", ref)
		},
		fold:   func(w *world) { w.n.ReadBack([]records.IPRef{ref}, nil, nil) },
		holder: "", taken: false,
	}, {
		name:  "a takeover that landed leaves the address under its new owner",
		setup: func(w *world) { w.own(blk.String(), 5); w.hold(owner("old"), "10.0.0.1", 6, false) },
		fold: func(w *world) {
			w.n.ReadBack([]records.IPRef{ref}, map[netip.Addr]records.Allocation{a1: {Record: records.Record{Owner: owner("new"), Node: "node-a", State: records.StateAllocated, Identity: "ns/web-0"}, Pool: "p", Block: blk, Addr: a1, Rev: 9}}, nil)
		},
		holder: owner("new").Key(), taken: true,
		check: func(t *testing.T, w *world) { require.Empty(t, w.ps.OfOwner(owner("old").Key())) },
	}, {
		name: "a release read back with a cooldown cools the address",
		setup: func(w *world) {
			d := allocator.Duration(time.Minute)
			w.ps.spec.ReuseCooldown = &d
			w.own(blk.String(), 5)
			w.hold(owner("a"), "10.0.0.1", 6, false)
		},
		fold: func(w *world) { w.n.ReadBack([]records.IPRef{ref}, nil, nil) },
		// Cooling: nobody's, still marked.
		holder: "", taken: true,
	}, {
		name:   "a fenced write loses the block; what was cached stays for the DEL",
		setup:  func(w *world) { w.own(blk.String(), 5); w.hold(owner("a"), "10.0.0.1", 6, false) },
		fold:   func(w *world) { w.n.Learn(&records.WriteError{Fenced: []netip.Prefix{blk}}) },
		holder: owner("a").Key(), taken: false,
		check: func(t *testing.T, w *world) {
			require.False(t, w.ps.Owns(blk))
			require.Contains(t, w.ps.others, blk, "the walk does not try the lost block again")
		},
	}, {
		name:   "a taken address found by a write is to be read again",
		setup:  func(w *world) { w.own(blk.String(), 5) },
		fold:   func(w *world) { require.Len(t, w.n.Learn(&records.WriteError{Taken: []netip.Addr{a1}}), 1) },
		holder: "", taken: false,
	}, {
		name:  "an empty block goes back only when another block of its family serves",
		setup: func(w *world) { w.own(blk.String(), 5) },
		fold:  func(w *world) {},
		check: func(t *testing.T, w *world) {
			require.False(t, w.n.Unclaimable(w.ps, blk), "the node's last block stays ready")
			w.own("10.0.0.4/30", 6)
			require.True(t, w.n.Unclaimable(w.ps, blk))
			w.hold(owner("a"), "10.0.0.1", 7, false)
			require.False(t, w.n.Unclaimable(w.ps, blk), "a block that holds an allocation stays")
		},
	}, {
		name:  "a lent address is marked, and free again when given back",
		setup: func(w *world) { w.own(blk.String(), 5) },
		fold:  func(w *world) { w.n.NoteLent("p", a1, "node-b", 8, true) },
		taken: true,
		check: func(t *testing.T, w *world) {
			w.n.NoteLent("p", a1, "node-b", 8, false)
			require.False(t, w.ps.own[blk].ba.IsUsed(a1))
		},
	}, {
		name: "a confirm is fenced by the block's claim, and the reservation's revision",
		setup: func(w *world) {
			w.own(blk.String(), 5)
			w.ps.own[blk].ba.Mark(a1)
			rec := records.Record{Owner: owner("a"), Node: "node-a", State: records.StateReserved, Since: t0}
			w.n.Wrote(w.ps, records.IPWrite{Pool: "p", Block: blk, Addr: a1, Record: rec, Reserve: true}, records.WriteResult{Rev: 6, Expires: t0.Add(time.Minute)})
		},
		fold:   func(w *world) {},
		holder: owner("a").Key(), taken: true,
		check: func(t *testing.T, w *world) {
			refs, fence := w.n.ConfirmNeeds(owner("a"))
			require.Empty(t, refs)
			require.False(t, fence)
			p, err := w.n.PlanConfirm(owner("a"), 0)
			require.NoError(t, err)
			require.Len(t, p.Writes, 1)
			require.Equal(t, int64(5), p.Writes[0].ClaimRev)
			require.Equal(t, int64(6), p.Writes[0].PrevRev)
			w.now = t0.Add(2 * time.Minute)
			_, err = w.n.PlanConfirm(owner("a"), 0)
			require.ErrorIs(t, err, records.ErrReservationGone, "a lapsed reservation is not confirmed")
		},
	}}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			w := newWorld(t, testPool(), nil)
			tc.setup(w)
			tc.fold(w)
			holder := ""
			if al := w.ps.At(a1); al != nil {
				holder = al.Owner.Key()
			}
			require.Equal(t, tc.holder, holder)
			if ob := w.ps.own[blk]; ob != nil {
				require.Equal(t, tc.taken, ob.ba.IsUsed(a1))
			} else {
				require.False(t, tc.taken, "no own block to mark")
			}
			if tc.check != nil {
				tc.check(t, w)
			}
		})
	}
}

// TestPlannerRestoreSteps: what a restore does with each block of a
// pool's listing.
func TestPlannerRestoreSteps(t *testing.T) {
	blk := netip.MustParsePrefix("10.0.0.0/30")
	me, other := &records.Claim{Node: "node-a"}, &records.Claim{Node: "node-b"}
	home := &records.Home{Node: "node-a"}
	cases := []struct {
		name string
		info records.BlockInfo
		want RestoreStep
	}{
		{"claimed on the current lease", records.BlockInfo{Block: blk, Claim: me, ClaimLease: 7, Home: home}, AdoptBlock},
		{"claimed on an earlier lease", records.BlockInfo{Block: blk, Claim: me, ClaimLease: 3, Home: home}, Reclaim},
		{"orphaned home", records.BlockInfo{Block: blk, Home: home}, Reclaim},
		{"home here, claim elsewhere", records.BlockInfo{Block: blk, Claim: other, Home: home}, HomeTaken},
		{"another node's", records.BlockInfo{Block: blk, Claim: other, Home: &records.Home{Node: "node-b"}}, Skip},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			w := newWorld(t, testPool(), nil)
			require.Equal(t, tc.want, w.n.RestoreStep(w.ps, tc.info, 7))
		})
	}
}
