package planner

import (
	"errors"
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
)

// The planner's decisions, table-driven, with no store: each case builds
// a node's cache through the fold functions the driver uses (a claim won,
// a write applied), plans one request, answers each need as a step of the
// case says, and checks the needs asked, the writes planned and the error.

var t0 = time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)

func testPool() allocator.Pool {
	return allocator.Pool{Name: "p", Rev: 1, BlockSizeV4: 30, BlockSizeV6: 126,
		CIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/28"), netip.MustParsePrefix("fd00::/124")}}
}

func owner(id string) records.Owner {
	return records.Owner{ContainerID: id, IfName: "eth0", Namespace: "ns", Pod: "pod-" + id}
}

// world is a node's planner and what the test made it hold.
type world struct {
	t   *testing.T
	n   *Node
	ps  *Pool
	now time.Time
}

func newWorld(t *testing.T, p allocator.Pool, labels map[string]string) *world {
	w := &world{t: t, now: t0}
	w.n = NewNode("node-a", labels, func() time.Time { return w.now }, nil)
	w.ps = w.n.Read(p)
	w.n.Replace([]*Pool{w.ps})
	return w
}

// own makes b an own block of the node, as a claim won at rev does.
func (w *world) own(b string, rev int64) netip.Prefix {
	blk := netip.MustParsePrefix(b)
	d, err := w.n.DraftClaim(w.ps, blk, nil)
	require.NoError(w.t, err)
	w.n.ClaimWon(w.ps, d, records.WriteResult{Rev: rev})
	return blk
}

// hold writes an allocation of o at addr into the cache, as an applied
// write does.
func (w *world) hold(o records.Owner, addr string, rev int64, borrowed bool) *records.Allocation {
	a := netip.MustParseAddr(addr)
	b, _ := w.ps.spec.BlockFor(a)
	if ob := w.ps.own[b]; ob != nil {
		ob.ba.Mark(a)
	}
	rec := records.Record{Owner: o, Node: "node-a", State: records.StateAllocated, Since: w.now, Borrowed: borrowed}
	return w.n.Wrote(w.ps, records.IPWrite{Pool: "p", Block: b, Addr: a, Record: rec, Borrowed: borrowed}, records.WriteResult{Rev: rev})
}

// step answers one need: the kind expected and how to fold the answer.
type step struct {
	want NeedKind
	fold func(w *world, p *Plan, n Need)
}

func run(w *world, r Request, steps []step) (*Plan, []NeedKind, error) {
	p, err := w.n.Start(r, nil)
	if err != nil {
		return nil, nil, err
	}
	var asked []NeedKind
	for i := 0; ; i++ {
		need, err := w.n.Advance(p)
		if err != nil {
			return p, asked, err
		}
		asked = append(asked, need.Kind)
		if need.Kind == Done {
			return p, asked, nil
		}
		require.Less(w.t, i, len(steps), "unexpected need %d after %v", need.Kind, asked)
		require.Equal(w.t, steps[i].want, need.Kind, "need %d", i)
		if steps[i].fold != nil {
			steps[i].fold(w, p, need)
		}
	}
}

func addrs(ws []records.IPWrite) []string {
	var out []string
	for _, x := range ws {
		out = append(out, x.Addr.String())
	}
	return out
}

func TestPlannerDecisions(t *testing.T) {
	v4 := []allocator.Family{allocator.IPv4}
	claimAs := func(b string, rev int64) func(*world, *Plan, Need) {
		return func(w *world, p *Plan, n Need) {
			require.NotNil(w.t, n.First, "a claim for a request carries its record")
			w.own(b, rev)
			p.Claimed(netip.MustParsePrefix(b))
		}
	}
	exhausted := func(w *world, p *Plan, n Need) { p.Failed(w.ps.Exhausted(n.Family)) }
	cases := []struct {
		name    string
		labels  map[string]string
		pool    func(*allocator.Pool)
		setup   func(w *world)
		req     Request
		steps   []step
		asked   []NeedKind
		writes  []string
		reused  int
		wantErr error
	}{{
		name:   "a free address in an own block is written at once",
		setup:  func(w *world) { w.own("10.0.0.0/30", 5) },
		req:    Request{Pool: "p", Owner: owner("a"), Families: v4},
		asked:  []NeedKind{Done},
		writes: []string{"10.0.0.1"},
	}, {
		name:   "no own block: room is looked for, then a block claimed for the request",
		req:    Request{Pool: "p", Owner: owner("a"), Families: v4},
		steps:  []step{{want: Room}, {want: Claim, fold: claimAs("10.0.0.4/30", 7)}},
		asked:  []NeedKind{Room, Claim, Done},
		writes: []string{"10.0.0.4"},
	}, {
		name: "an exhausted pool borrows, and the borrowed address is the owner's",
		req:  Request{Pool: "p", Owner: owner("a"), Families: v4},
		steps: []step{{want: Room}, {want: Claim, fold: exhausted}, {want: Borrow, fold: func(w *world, p *Plan, n Need) {
			p.Written(w.hold(owner("a"), "10.0.0.9", 9, true))
		}}},
		asked:  []NeedKind{Room, Claim, Borrow, Done},
		reused: 1,
	}, {
		name: "at the pool's maxBlocksPerNode a full node borrows rather than claims",
		pool: func(p *allocator.Pool) { p.MaxBlocksPerNode = 1 },
		setup: func(w *world) {
			w.own("10.0.0.0/30", 5)
			for i, a := range []string{"10.0.0.1", "10.0.0.2", "10.0.0.3"} {
				w.hold(owner(fmt.Sprint("x", i)), a, 6, false)
			}
		},
		req: Request{Pool: "p", Owner: owner("a"), Families: v4},
		steps: []step{{want: Room}, {want: Borrow, fold: func(w *world, p *Plan, n Need) {
			require.False(w.t, w.ps.HasClaimable(allocator.IPv4, records.PoolSnapshot{}), "no block is claimable at the limit")
			p.Written(w.hold(owner("a"), "10.0.0.9", 9, true))
		}}},
		asked:  []NeedKind{Room, Borrow, Done},
		reused: 1,
	}, {
		name: "below the pool's maxBlocksPerNode a full node claims",
		pool: func(p *allocator.Pool) { p.MaxBlocksPerNode = 2 },
		setup: func(w *world) {
			w.own("10.0.0.0/30", 5)
			for i, a := range []string{"10.0.0.1", "10.0.0.2", "10.0.0.3"} {
				w.hold(owner(fmt.Sprint("x", i)), a, 6, false)
			}
		},
		req:    Request{Pool: "p", Owner: owner("a"), Families: v4},
		steps:  []step{{want: Room}, {want: Claim, fold: claimAs("10.0.0.4/30", 7)}},
		asked:  []NeedKind{Room, Claim, Done},
		writes: []string{"10.0.0.4"},
	}, {
		name: "a borrow that finds own room plans again from the start",
		setup: func(w *world) {
			w.own("10.0.0.0/30", 5)
			for i, a := range []string{"10.0.0.1", "10.0.0.2", "10.0.0.3"} {
				w.hold(owner(fmt.Sprint("x", i)), a, 6, false)
			}
		},
		req: Request{Pool: "p", Owner: owner("a"), Families: v4},
		steps: []step{{want: Room}, {want: Claim, fold: exhausted}, {want: Borrow, fold: func(w *world, p *Plan, n Need) {
			w.ps.drop(w.ps.byAddr[netip.MustParseAddr("10.0.0.2")]) // a lent address came back
			p.OwnRoom()
		}}},
		asked:  []NeedKind{Room, Claim, Borrow, Done},
		writes: []string{"10.0.0.2"},
	}, {
		name:   "what the owner holds is reused, not written again",
		setup:  func(w *world) { w.own("10.0.0.0/30", 5); w.hold(owner("a"), "10.0.0.1", 6, false) },
		req:    Request{Pool: "p", Owner: owner("a"), Families: v4},
		asked:  []NeedKind{Done},
		reused: 1,
	}, {
		name: "a reservation is told again only after a read back says etcd holds it",
		setup: func(w *world) {
			w.own("10.0.0.0/30", 5)
			w.ps.own[netip.MustParsePrefix("10.0.0.0/30")].ba.Mark(netip.MustParseAddr("10.0.0.1"))
			rec := records.Record{Owner: owner("a"), Node: "node-a", State: records.StateReserved, Since: t0}
			w.n.Wrote(w.ps, records.IPWrite{Pool: "p", Block: netip.MustParsePrefix("10.0.0.0/30"), Addr: netip.MustParseAddr("10.0.0.1"), Record: rec, Reserve: true},
				records.WriteResult{Rev: 6, Expires: t0.Add(time.Hour)})
		},
		req: Request{Pool: "p", Owner: owner("a"), Families: v4},
		steps: []step{{want: ReadBack, fold: func(w *world, p *Plan, n Need) {
			w.n.ReadBack(n.Refs, nil, nil) // its lease was revoked early: etcd holds nothing there
		}}},
		asked:  []NeedKind{ReadBack, Done},
		writes: []string{"10.0.0.2"},
	}, {
		name:    "a disabled pool hands out nothing new",
		pool:    func(p *allocator.Pool) { p.Disabled = true },
		req:     Request{Pool: "p", Owner: owner("a"), Families: v4},
		wantErr: records.ErrPoolDisabled,
	}, {
		name:    "a pool whose selector leaves the node out",
		pool:    func(p *allocator.Pool) { p.NodeSelector = "rack=r1" },
		labels:  map[string]string{"rack": "r2"},
		req:     Request{Pool: "p", Owner: owner("a"), Families: v4},
		wantErr: records.ErrNodeNotSelected,
	}, {
		name:   "a static address in an own block",
		setup:  func(w *world) { w.own("10.0.0.0/30", 5) },
		req:    Request{Pool: "p", Owner: owner("a"), IPs: []netip.Addr{netip.MustParseAddr("10.0.0.2")}},
		asked:  []NeedKind{Done},
		writes: []string{"10.0.0.2"},
	}, {
		name:    "a static address another owner holds",
		setup:   func(w *world) { w.own("10.0.0.0/30", 5); w.hold(owner("b"), "10.0.0.2", 6, false) },
		req:     Request{Pool: "p", Owner: owner("a"), IPs: []netip.Addr{netip.MustParseAddr("10.0.0.2")}},
		wantErr: records.ErrIPInUse,
	}, {
		// Its lease may have ended in etcd before this node's estimate of
		// it (read at a restore, with a margin): the block is read again
		// rather than the address refused on the cache's word.
		name: "a static address another owner holds as a reservation: read again, then written if etcd has it free",
		setup: func(w *world) {
			w.own("10.0.0.0/30", 5)
			w.hold(owner("b"), "10.0.0.2", 6, false).State = records.StateReserved
		},
		req: Request{Pool: "p", Owner: owner("a"), IPs: []netip.Addr{netip.MustParseAddr("10.0.0.2")}},
		steps: []step{{want: Reload, fold: func(w *world, p *Plan, n Need) {
			w.n.Load(w.ps, n.Block, nil, nil) // etcd holds nothing there now
		}}},
		asked:  []NeedKind{Reload, Done},
		writes: []string{"10.0.0.2"},
	}, {
		name:  "a static address in a block nobody claims: the block is claimed",
		req:   Request{Pool: "p", Owner: owner("a"), IPs: []netip.Addr{netip.MustParseAddr("10.0.0.9")}},
		steps: []step{{want: ClaimBlock, fold: func(w *world, p *Plan, n Need) { w.own(n.Block.String(), 8); p.Claimed(n.Block) }}},
		asked: []NeedKind{ClaimBlock, Done}, writes: []string{"10.0.0.9"},
	}, {
		name: "a static address in another live node's block is borrowed",
		setup: func(w *world) {
			w.ps.ClaimLost(netip.MustParsePrefix("10.0.0.8/30"), "node-b", false)
		},
		req: Request{Pool: "p", Owner: owner("a"), IPs: []netip.Addr{netip.MustParseAddr("10.0.0.9")}},
		steps: []step{{want: BorrowAt, fold: func(w *world, p *Plan, n Need) {
			require.True(w.t, n.First.Borrowed)
			p.Written(w.hold(owner("a"), "10.0.0.9", 9, true))
		}}},
		asked: []NeedKind{BorrowAt, Done}, reused: 1,
	}, {
		name: "a static address in a draining cidr",
		pool: func(p *allocator.Pool) {
			p.CIDRs = append(p.CIDRs, netip.MustParsePrefix("10.0.1.0/28"))
			p.Draining = []netip.Prefix{netip.MustParsePrefix("10.0.0.0/28")}
		},
		req:     Request{Pool: "p", Owner: owner("a"), IPs: []netip.Addr{netip.MustParseAddr("10.0.0.9")}},
		wantErr: records.ErrBadRequest,
	}, {
		name:  "a sticky identity without a binding plans in the node's blocks and binds",
		setup: func(w *world) { w.own("10.0.0.0/30", 5) },
		req:   Request{Pool: "p", Owner: owner("a"), Families: v4, Sticky: &records.Sticky{Identity: "ns/web-0", Window: time.Minute}},
		steps: []step{{want: ReadBinding, fold: func(w *world, p *Plan, n Need) { p.Binding(records.Binding{}, false) }}},
		asked: []NeedKind{ReadBinding, Done}, writes: []string{"10.0.0.1"},
	}, {
		name:  "a sticky identity held by another live pod",
		setup: func(w *world) { w.own("10.0.0.0/30", 5) },
		req:   Request{Pool: "p", Owner: owner("a"), Families: v4, Sticky: &records.Sticky{Identity: "ns/web-0", Window: time.Minute}},
		steps: []step{{want: ReadBinding, fold: func(w *world, p *Plan, n Need) {
			p.Binding(records.Binding{Identity: "ns/web-0", Owner: owner("b"), Node: "node-b", Pool: "p", Addrs: []netip.Addr{netip.MustParseAddr("10.0.0.9")}, Rev: 3}, true)
		}}, {want: ReadBound, fold: func(w *world, p *Plan, n Need) {
			p.Bound(map[netip.Addr]records.Allocation{netip.MustParseAddr("10.0.0.9"): {Record: records.Record{Owner: owner("b"), Node: "node-b", Identity: "ns/web-0"}, Rev: 3}})
		}}},
		wantErr: records.ErrIdentityInUse,
	}, {
		name:  "a kept sticky identity is taken over, compared and fenced",
		setup: func(w *world) { w.own("10.0.0.0/30", 5) },
		req:   Request{Pool: "p", Owner: owner("a"), Families: v4, Sticky: &records.Sticky{Identity: "ns/web-0", Window: time.Minute}},
		steps: []step{{want: ReadBinding, fold: func(w *world, p *Plan, n Need) {
			p.Binding(records.Binding{Identity: "ns/web-0", Node: "node-b", Pool: "p", Addrs: []netip.Addr{netip.MustParseAddr("10.0.0.9")}, Rev: 3, WindowSeconds: 60, Since: t0}, true)
		}}, {want: ReadBound, fold: func(w *world, p *Plan, n Need) {
			p.Bound(map[netip.Addr]records.Allocation{netip.MustParseAddr("10.0.0.9"): {Record: records.Record{Owner: owner("b"), State: records.StateKept, Identity: "ns/web-0"}, Rev: 4}})
		}}, {want: Fence, fold: func(w *world, p *Plan, n Need) { p.Fence(11) }}},
		asked: []NeedKind{ReadBinding, ReadBound, Fence, Done}, writes: []string{"10.0.0.9"},
	}, {
		name: "a takeover first releases what the owner holds of its own in the families it takes",
		setup: func(w *world) {
			w.own("10.0.0.0/30", 5)
			w.hold(owner("a"), "10.0.0.1", 6, false) // an earlier try's write that landed, read back
		},
		req: Request{Pool: "p", Owner: owner("a"), Families: v4, Sticky: &records.Sticky{Identity: "ns/web-0", Window: time.Minute}},
		steps: []step{{want: ReadBinding, fold: func(w *world, p *Plan, n Need) {
			p.Binding(records.Binding{Identity: "ns/web-0", Node: "node-b", Pool: "p", Addrs: []netip.Addr{netip.MustParseAddr("10.0.0.9")}, Rev: 3, WindowSeconds: 60, Since: t0}, true)
		}}, {want: ReadBound, fold: func(w *world, p *Plan, n Need) {
			p.Bound(map[netip.Addr]records.Allocation{netip.MustParseAddr("10.0.0.9"): {Record: records.Record{Owner: owner("b"), State: records.StateKept, Identity: "ns/web-0"}, Rev: 4}})
		}}, {want: Release, fold: func(w *world, p *Plan, n Need) {
			require.Len(w.t, n.Allocs, 1)
			require.Equal(w.t, "10.0.0.1", n.Allocs[0].Addr.String())
			w.n.Released(w.ps, n.Allocs[0])
		}}, {want: Fence, fold: func(w *world, p *Plan, n Need) { p.Fence(11) }}},
		asked: []NeedKind{ReadBinding, ReadBound, Release, Fence, Done}, writes: []string{"10.0.0.9"},
	}, {
		name:  "a takeover onto a node the selector leaves out",
		pool:  func(p *allocator.Pool) { p.NodeSelector = "rack=r1" },
		setup: func(w *world) {},
		req:   Request{Pool: "p", Owner: owner("a"), Families: v4, Sticky: &records.Sticky{Identity: "ns/web-0", Window: time.Minute}},
		steps: []step{{want: ReadBinding, fold: func(w *world, p *Plan, n Need) {
			p.Binding(records.Binding{Identity: "ns/web-0", Node: "node-b", Pool: "p", Addrs: []netip.Addr{netip.MustParseAddr("10.0.0.9")}, Rev: 3, WindowSeconds: 60, Since: t0}, true)
		}}, {want: ReadBound, fold: func(w *world, p *Plan, n Need) {
			p.Bound(map[netip.Addr]records.Allocation{netip.MustParseAddr("10.0.0.9"): {Record: records.Record{Owner: owner("b"), State: records.StateKept, Identity: "ns/web-0"}, Rev: 4}})
		}}},
		wantErr: records.ErrNodeNotSelected,
	}}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := testPool()
			if tc.pool != nil {
				tc.pool(&p)
			}
			w := newWorld(t, p, tc.labels)
			if tc.setup != nil {
				tc.setup(w)
			}
			plan, asked, err := run(w, tc.req, tc.steps)
			if tc.wantErr != nil {
				require.ErrorIs(t, err, tc.wantErr)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.asked, asked)
			require.Equal(t, tc.writes, addrs(plan.Writes))
			require.Len(t, plan.Reused, tc.reused)
			for _, x := range plan.Writes {
				if !x.Borrowed {
					require.True(t, w.ps.own[x.Block].ba.IsUsed(x.Addr), "a planned address is marked")
				}
			}
			if tc.req.Sticky != nil {
				require.NotNil(t, plan.Bind, "a sticky plan carries its binding")
			}
			w.n.Undo(plan)
			for _, x := range plan.Writes {
				require.False(t, w.ps.planned[x.Addr])
			}
		})
	}
}

// TestPlannerLapsedReservation: a reservation whose lease has ended is
// dropped when the planner looks at it, freeing its address, and the
// lapse is an event the driver records in IP history.
func TestPlannerLapsedReservation(t *testing.T) {
	w := newWorld(t, testPool(), nil)
	w.own("10.0.0.0/30", 5)
	a := netip.MustParseAddr("10.0.0.1")
	w.ps.own[netip.MustParsePrefix("10.0.0.0/30")].ba.Mark(a)
	rec := records.Record{Owner: owner("old"), Node: "node-a", State: records.StateReserved, Since: t0}
	w.n.Wrote(w.ps, records.IPWrite{Pool: "p", Block: netip.MustParsePrefix("10.0.0.0/30"), Addr: a, Record: rec, Reserve: true}, records.WriteResult{Rev: 6, Expires: t0.Add(time.Second)})
	w.n.Events()
	w.now = t0.Add(2 * time.Second)
	p, _, err := run(w, Request{Pool: "p", Owner: owner("old"), Families: []allocator.Family{allocator.IPv4}}, nil)
	require.NoError(t, err)
	require.Empty(t, p.Reused, "a lapsed reservation is not the owner's any more")
	var lapsed bool
	for _, e := range w.n.Events() {
		lapsed = lapsed || (e.Kind == Lapsed && e.Al.Addr == a && e.End.Equal(t0.Add(time.Second)))
	}
	require.True(t, lapsed, "the lapse is reported with its end")
}

// TestPlannerPendingOwnerWaits: an owner with a write of unknown outcome
// is refused until it is settled, with the settle's error.
func TestPlannerPendingOwnerWaits(t *testing.T) {
	w := newWorld(t, testPool(), nil)
	b := w.own("10.0.0.0/30", 5)
	w.n.Park(w.ps, owner("a").Key(), "write", records.IPRef{Pool: "p", Block: b, Addr: netip.MustParseAddr("10.0.0.1")})
	cause := errors.New("etcd did not answer")
	_, err := w.n.Start(Request{Pool: "p", Owner: owner("a")}, cause)
	require.ErrorIs(t, err, retry.ErrUnavailable)
	require.ErrorIs(t, err, cause)
	w.n.ReadBack(w.n.Parked(), nil, nil)
	_, err = w.n.Start(Request{Pool: "p", Owner: owner("a")}, nil)
	require.NoError(t, err, "settled as absent, the owner plans again")
}

// TestPlannerConfirmedBeforeLeftoverReservation: an owner holds a
// reservation of an earlier try of its ADD, read back after the node took
// it for lapsed (etcd's lease ends at the earliest when the node
// expects), and the address its retry got and confirmed, in one family.
// A further retry gets the confirmed one, whichever the cache lists
// first.
func TestPlannerConfirmedBeforeLeftoverReservation(t *testing.T) {
	for _, reservedFirst := range []bool{true, false} {
		w := newWorld(t, testPool(), nil)
		blk := w.own("10.0.0.0/30", 5)
		o := owner("pod")
		left := netip.MustParseAddr("10.0.0.1")
		reserve := func() {
			w.ps.own[blk].ba.Mark(left)
			rec := records.Record{Owner: o, Node: "node-a", State: records.StateReserved, Since: t0}
			w.n.Wrote(w.ps, records.IPWrite{Pool: "p", Block: blk, Addr: left, Record: rec, Reserve: true}, records.WriteResult{Rev: 6, Expires: t0.Add(time.Minute)})
		}
		if reservedFirst {
			reserve()
			w.hold(o, "10.0.0.2", 7, false)
		} else {
			w.hold(o, "10.0.0.2", 7, false)
			reserve()
		}
		p, _, err := run(w, Request{Pool: "p", Owner: o, Families: []allocator.Family{allocator.IPv4}}, nil)
		require.NoError(t, err)
		require.Len(t, p.Reused, 1)
		require.Equal(t, "10.0.0.2", p.Reused[0].Addr.String(), "reserved first: %v", reservedFirst)
	}
}
