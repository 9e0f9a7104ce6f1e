package inspect_test

import (
	"bytes"
	"context"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/inspect"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
)

func auditLog() (hclog.Logger, *bytes.Buffer) {
	var buf bytes.Buffer
	return hclog.New(&hclog.LoggerOptions{Name: "audit", Output: &buf}), &buf
}

func TestReleaseRefusesLiveNodeUnlessForced(t *testing.T) {
	v := newEnv(t)
	n1 := startAgent(t, v.e, "n1", 0)
	al := allocate(t, n1, 0, 2, false)
	s := v.snapshot(t)
	for name, plan := range map[string]func(force bool) (inspect.Plan, error){
		"ip": func(f bool) (inspect.Plan, error) {
			return inspect.PlanReleaseIP(s, "small", al[0].Addr, inspect.Evidence{}, f)
		},
		"owner": func(f bool) (inspect.Plan, error) {
			return inspect.PlanReleaseOwner(s, owner(0).ContainerID, "", inspect.Evidence{}, f)
		},
		"node": func(f bool) (inspect.Plan, error) { return inspect.PlanReleaseNode(s, "n1", inspect.Evidence{}, f) },
		"node remove": func(f bool) (inspect.Plan, error) {
			return inspect.PlanNodeRemove(s, "n1", gone("n1"), f)
		},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := plan(false)
			require.ErrorIs(t, err, inspect.ErrNodeAlive)
			require.ErrorContains(t, err, "n1")
			p, err := plan(true)
			require.NoError(t, err)
			require.NotEmpty(t, p.Steps)
			for _, st := range p.Steps {
				for _, g := range st.Guards {
					require.NotEqual(t, etcdstore.NodeKey("n1"), g.Key, "a forced plan is not fenced on the node record")
				}
			}
		})
	}
	// Forced, the release goes through.
	p, err := inspect.PlanReleaseIP(s, "", al[0].Addr, inspect.Evidence{}, true)
	require.NoError(t, err)
	res, err := v.in.Execute(t.Context(), p, nil)
	require.NoError(t, err)
	require.Equal(t, 1, res.Deleted)
	require.False(t, v.exists(t, p.Steps[0].Key))
}

func TestReleaseDeadNode(t *testing.T) {
	for _, tc := range []struct {
		name  string
		plan  func(s *inspect.Snapshot, al []records.Allocation) (inspect.Plan, error)
		gone  int // allocations released
		after int // allocations of n1 left
	}{
		{"by ip", func(s *inspect.Snapshot, al []records.Allocation) (inspect.Plan, error) {
			return inspect.PlanReleaseIP(s, "small", al[3].Addr, gone("n1"), false)
		}, 1, 19},
		{"by ip without pool", func(s *inspect.Snapshot, al []records.Allocation) (inspect.Plan, error) {
			return inspect.PlanReleaseIP(s, "", al[3].Addr, gone("n1"), false)
		}, 1, 19},
		{"by owner", func(s *inspect.Snapshot, al []records.Allocation) (inspect.Plan, error) {
			return inspect.PlanReleaseOwner(s, owner(4).ContainerID, "", gone("n1"), false)
		}, 2, 18}, // eth0 and net1
		{"by owner and interface", func(s *inspect.Snapshot, al []records.Allocation) (inspect.Plan, error) {
			return inspect.PlanReleaseOwner(s, owner(4).ContainerID, "net1", gone("n1"), false)
		}, 1, 19},
		{"by node", func(s *inspect.Snapshot, al []records.Allocation) (inspect.Plan, error) {
			return inspect.PlanReleaseNode(s, "n1", gone("n1"), false)
		}, 20, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			v := newEnv(t)
			n1 := startAgent(t, v.e, "n1", 0)
			al := allocate(t, n1, 0, 19, false)
			o := owner(4)
			o.IfName = "net1"
			_, err := n1.Alloc.Allocate(t.Context(), nodealloc.Request{Pool: "small", Owner: o})
			require.NoError(t, err)
			n1.Kill(t)

			s := v.snapshot(t)
			p, err := tc.plan(s, al)
			require.NoError(t, err)
			require.Len(t, p.Steps, tc.gone)
			for _, st := range p.Steps {
				require.Equal(t, inspect.StepIP, st.Kind)
				require.Equal(t, []inspect.Guard{{Key: etcdstore.NodeKey("n1")}}, st.Guards)
			}
			// The plan alone (a dry run) changes nothing.
			require.Equal(t, int64(20), v.count(t, etcdstore.IPsPrefix("small")))

			log, buf := auditLog()
			res, err := v.in.Execute(t.Context(), p, log)
			require.NoError(t, err)
			require.Equal(t, tc.gone, res.Deleted)
			require.Equal(t, int64(tc.after), v.count(t, etcdstore.IPsPrefix("small")))
			for _, st := range p.Steps {
				require.False(t, v.exists(t, st.Key))
				require.Contains(t, buf.String(), st.Key, "every deleted key is in the audit log")
			}
			require.Equal(t, tc.gone, strings.Count(buf.String(), "deleted key"))

			// Running the plan again is harmless.
			res, err = v.in.Execute(t.Context(), p, nil)
			require.NoError(t, err)
			for _, o := range res.Outcomes {
				require.Equal(t, inspect.StatusGone, o.Status)
			}
		})
	}
}

func TestReleaseIsRevisionGuarded(t *testing.T) {
	v := newEnv(t)
	n1 := startAgent(t, v.e, "n1", 0)
	al := allocate(t, n1, 0, 2, false)
	n1.Kill(t)
	p, err := inspect.PlanReleaseNode(v.snapshot(t), "n1", gone("n1"), false)
	require.NoError(t, err)

	// One address is rewritten after the plan (say the node came back and
	// handed it out again); the stale plan must not delete it.
	key := etcdstore.IPKey("small", al[1].Block, al[1].Addr)
	v.put(t, key, record(owner(9), "n1", records.StateAllocated))
	res, err := v.in.Execute(t.Context(), p, nil)
	require.ErrorIs(t, err, retry.ErrConflict)
	require.ErrorContains(t, err, "changed since the plan")
	require.Equal(t, 1, res.Deleted)
	require.Equal(t, 1, res.Failed)
	require.True(t, v.exists(t, key))

	// A node that comes back fences the rest of a stale plan too.
	_, err = v.cli.Put(context.Background(), etcdstore.NodeKey("n1"), "{}")
	require.NoError(t, err)
	p, err = inspect.PlanReleaseNode(v.snapshot(t), "n1", inspect.Evidence{}, true) // planned while forced...
	require.NoError(t, err)
	p.Steps[0].Guards = []inspect.Guard{{Key: etcdstore.NodeKey("n1")}} // ...but fenced as an unforced plan is
	_, err = v.in.Execute(t.Context(), p, nil)
	require.ErrorContains(t, err, "exists again")
	require.True(t, v.exists(t, key))
}

func TestPlanReleaseIPAmbiguous(t *testing.T) {
	rec := record(owner(1), "gone", records.StateAllocated)
	a := netip.MustParseAddr("10.0.0.5")
	s := &inspect.Snapshot{IPs: []inspect.IP{
		{Record: rec, Pool: "a", Block: netip.MustParsePrefix("10.0.0.0/28"), Addr: a, Key: "k1"},
		{Record: rec, Pool: "b", Block: netip.MustParsePrefix("10.0.0.0/28"), Addr: a, Key: "k2"},
	}}
	_, err := inspect.PlanReleaseIP(s, "", a, gone("gone"), false)
	require.ErrorIs(t, err, inspect.ErrAmbiguous)
	p, err := inspect.PlanReleaseIP(s, "b", a, gone("gone"), false)
	require.NoError(t, err)
	require.Len(t, p.Steps, 1)
	require.Equal(t, "k2", p.Steps[0].Key)
	p, err = inspect.PlanReleaseIP(s, "b", netip.MustParseAddr("10.0.0.6"), gone("gone"), false)
	require.NoError(t, err)
	require.Empty(t, p.Steps, "nothing to release is an empty plan")
	_, err = inspect.PlanReleaseOwner(s, "", "", gone("gone"), false)
	require.ErrorIs(t, err, inspect.ErrBadRequest)
}

// TestReleaseNeedsEvidence: a node without a node record may only be cut
// off from etcd (its lease ran out during a partition) while its pods go
// on using their addresses. Releasing them hands them to a second owner
// (invariant 1), so a release of a node that is not live needs the same
// evidence as node remove, forced or not; a live node is refused unless
// forced, as before.
func TestReleaseNeedsEvidence(t *testing.T) {
	v := newEnv(t)
	n1 := startAgent(t, v.e, "n1", 0)
	al := allocate(t, n1, 0, 3, false)
	n1.Kill(t) // partitioned: its record and claims go, its pods run on
	n2 := startAgent(t, v.e, "n2", 0)
	live := allocate(t, n2, 10, 1, false)
	s := v.snapshot(t)
	lastSeen := time.Now().UTC()
	plans := map[string]func(ev inspect.Evidence, force bool) (inspect.Plan, error){
		"ip": func(ev inspect.Evidence, f bool) (inspect.Plan, error) {
			return inspect.PlanReleaseIP(s, "small", al[0].Addr, ev, f)
		},
		"owner": func(ev inspect.Evidence, f bool) (inspect.Plan, error) {
			return inspect.PlanReleaseOwner(s, owner(1).ContainerID, "", ev, f)
		},
		"node": func(ev inspect.Evidence, f bool) (inspect.Plan, error) {
			return inspect.PlanReleaseNode(s, "n1", ev, f)
		},
	}
	for name, plan := range plans {
		t.Run(name, func(t *testing.T) {
			for _, force := range []bool{false, true} {
				for _, bad := range []struct {
					ev   inspect.Evidence
					want error
				}{
					{inspect.Evidence{}, inspect.ErrNoEvidence},
					{inspect.Evidence{ConfirmGone: "n1"}, inspect.ErrNoEvidence},
					{inspect.Evidence{ConfirmGone: "n2", LastSeen: lastSeen}, inspect.ErrNoEvidence},
					// An hour ago, before n1 wrote its allocations.
					{inspect.Evidence{ConfirmGone: "n1", LastSeen: lastSeen.Add(-time.Hour)}, inspect.ErrEvidenceContradicted},
				} {
					_, err := plan(bad.ev, force)
					require.ErrorIs(t, err, bad.want, "force %v, evidence %+v", force, bad.ev)
					var ee *inspect.EvidenceError
					require.ErrorAs(t, err, &ee)
					require.Equal(t, "n1", ee.Node, "the refusal names the node to state is gone")
				}
			}
			ev := gone("n1")
			p, err := plan(ev, false)
			require.NoError(t, err)
			require.NotEmpty(t, p.Steps)
			require.Equal(t, &ev, p.Evidence, "the statement is kept in the plan for the audit trail")
			for _, st := range p.Steps {
				require.Equal(t, []inspect.Guard{{Key: etcdstore.NodeKey("n1")}}, st.Guards, "still fenced on n1 staying away")
			}
		})
	}

	// The evidence releases n1's addresses; n2's live one is still refused
	// unless forced, with or without evidence.
	p, err := inspect.PlanReleaseNode(s, "n1", gone("n1"), false)
	require.NoError(t, err)
	res, err := v.in.Execute(t.Context(), p, nil)
	require.NoError(t, err)
	require.Equal(t, 3, res.Deleted)
	_, err = inspect.PlanReleaseIP(s, "small", live[0].Addr, gone("n2"), false)
	require.ErrorIs(t, err, inspect.ErrNodeAlive)
	p, err = inspect.PlanReleaseIP(s, "small", live[0].Addr, inspect.Evidence{}, true)
	require.NoError(t, err, "a forced release of a live node's address needs no evidence")
	require.Len(t, p.Steps, 1)
	require.Nil(t, p.Evidence)
}
