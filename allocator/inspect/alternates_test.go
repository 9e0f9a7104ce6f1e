package inspect_test

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/inspect"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/allocator/schema"
	"github.com/kvipam/kvipam/internal/foundation/retry"
)

// migration is a VM's live migration in the small pool: its source pod
// on src, admitted on dst as the identity's second owner.
type migration struct {
	src, dst records.Owner
	addrs    []netip.Addr
}

func vmRequest(gen, job string) nodealloc.Request {
	o := records.Owner{ContainerID: "launcher-" + gen, IfName: "eth0", Namespace: "ns", Pod: "virt-launcher-vm1-" + gen}
	return nodealloc.Request{Pool: "small", Owner: o, Sticky: &records.Sticky{Identity: "ns/vm1", Window: time.Hour}, Migration: job}
}

func startMigration(t *testing.T, src, dst *agent) migration {
	t.Helper()
	ctx := t.Context()
	_, _, err := src.Store.RaiseSchema(ctx, schema.Highest(), src.Name, "test")
	require.NoError(t, err)
	res, err := src.Alloc.Allocate(ctx, vmRequest("src", ""))
	require.NoError(t, err)
	_, ok, err := dst.Alloc.Admit(ctx, vmRequest("dst", "job"))
	require.NoError(t, err)
	require.True(t, ok, "admitted as the alternate")
	m := migration{src: vmRequest("src", "").Owner, dst: vmRequest("dst", "").Owner}
	for _, al := range res.Allocations {
		m.addrs = append(m.addrs, al.Addr)
	}
	return m
}

// migrationToGoneNode starts a migration from n1 to n2, then n2 goes (its
// lease ends, as a node gone for good).
func migrationToGoneNode(t *testing.T) (*env, *agent, migration) {
	t.Helper()
	v := newEnv(t)
	n1 := startAgent(t, v.e, "n1", 0)
	n2 := startAgent(t, v.e, "n2", 0)
	m := startMigration(t, n1, n2)
	n2.Kill(t)
	return v, n1, m
}

// alternateIn is the alternate the binding of ns/vm1 and each record of
// its addresses name ("" none), failing when they disagree.
func alternateIn(t *testing.T, v *env, m migration) string {
	t.Helper()
	s := v.snapshot(t)
	alt := ""
	for _, b := range s.Bindings {
		if b.Identity == "ns/vm1" && b.Alternate != nil {
			alt = b.Alternate.Owner.Key() + "@" + b.Alternate.Node
		}
	}
	for _, ip := range s.IPs {
		if ip.Identity != "ns/vm1" {
			continue
		}
		got := ""
		if ip.Alternate != nil {
			got = ip.Alternate.Owner.Key() + "@" + ip.Alternate.Node
		}
		require.Equal(t, alt, got, "the record of %s and the binding disagree on the alternate", ip.Addr)
	}
	return alt
}

// TestNodeRemoveEndsMigrationToIt: a VM's source pod runs on live n1, its
// target was admitted on n2 as the migration's second owner, and n2 is
// gone for good. The source's DEL is refused while the alternate's node
// is away (no live record is no proof that its pod is gone), so only
// node remove n2, with the operator's statement, can end the migration:
// the binding and the address records lose the alternate, IP history
// gets the second owner's interval ended node-remove, and the source's
// DEL then goes through as any sticky DEL.
func TestNodeRemoveEndsMigrationToIt(t *testing.T) {
	ctx := t.Context()
	v, n1, m := migrationToGoneNode(t)

	_, err := n1.Alloc.Release(ctx, m.src)
	require.ErrorIs(t, err, retry.ErrUnavailable, "the source's DEL waits for the alternate's node")
	require.Equal(t, m.dst.Key()+"@n2", alternateIn(t, v, m))

	p, err := inspect.PlanNodeRemove(v.snapshot(t), "n2", gone("n2"), false)
	require.NoError(t, err)
	var drops []inspect.Step
	for _, st := range p.Steps {
		if st.Kind == inspect.StepAlternate {
			drops = append(drops, st)
		}
	}
	require.Len(t, drops, 1, "one step ends the migration: %+v", p.Steps)
	require.Equal(t, m.dst.Key(), drops[0].Owner)
	require.Contains(t, drops[0].Guards, inspect.Guard{Key: etcdstore.NodeKey("n2")}, "fenced by n2 staying gone")

	in := inspect.New(v.cli, inspect.Options{History: etcdstore.NewHistoryRecorder(v.cli, etcdstore.DefaultHistoryRetention)})
	_, err = in.Execute(ctx, p, nil)
	require.NoError(t, err)
	require.Empty(t, alternateIn(t, v, m), "node remove ended the migration")
	for _, a := range m.addrs {
		hist, err := n1.Store.History(ctx, etcdstore.HistoryFilter{Pool: "small", IP: a})
		require.NoError(t, err)
		require.Len(t, hist, 1, "the second owner's interval of %s", a)
		require.Equal(t, m.dst.Key(), hist[0].Owner.Key())
		require.Equal(t, "n2", hist[0].Node)
		require.Equal(t, etcdstore.EndNodeRemove, hist[0].Reason)
	}

	kept, err := n1.Alloc.Release(ctx, m.src)
	require.NoError(t, err, "the source's DEL goes through once the migration has ended")
	require.Len(t, kept, len(m.addrs))
}

// TestNodeRemoveKeepsMigrationToReturningNode: n2 comes back between the
// plan and its execution: its target pod may run there, so the step that
// would end the migration fails on its fence and the alternate stays.
func TestNodeRemoveKeepsMigrationToReturningNode(t *testing.T) {
	v, _, m := migrationToGoneNode(t)

	p, err := inspect.PlanNodeRemove(v.snapshot(t), "n2", gone("n2"), false)
	require.NoError(t, err)
	v.put(t, etcdstore.NodeKey("n2"), map[string]string{"name": "n2"})
	res, err := v.in.Execute(t.Context(), p, nil)
	require.ErrorIs(t, err, retry.ErrConflict)
	require.Equal(t, 1, res.Failed)
	require.Equal(t, m.dst.Key()+"@n2", alternateIn(t, v, m), "the alternate stays with its node back")
}

// TestOperatorAlternateDropAnswerLostSettled: node remove's end of a
// migration commits and its answer is lost. Execute settles it from
// etcd, as every write of unknown outcome: the step is done, not failed,
// and running the plan again plans nothing more for it.
func TestOperatorAlternateDropAnswerLostSettled(t *testing.T) {
	v, _, m := migrationToGoneNode(t)

	p, err := inspect.PlanNodeRemove(v.snapshot(t), "n2", gone("n2"), false)
	require.NoError(t, err)
	lost := &lostAnswers{Client: v.cli}
	in := inspect.New(lost, inspect.Options{})
	for i, st := range p.Steps {
		one := p
		one.Steps = p.Steps[i : i+1]
		if st.Kind == inspect.StepAlternate {
			lost.n = 1
		}
		res, err := in.Execute(context.Background(), one, nil)
		require.NoError(t, err, "step %+v: settled from etcd", st)
		require.Equal(t, 1, res.Deleted)
	}
	require.Zero(t, lost.n, "the drop's answer was lost")
	require.Empty(t, alternateIn(t, v, m))
	again, err := inspect.PlanNodeRemove(v.snapshot(t), "n2", gone("n2"), false)
	require.NoError(t, err)
	for _, st := range again.Steps {
		require.NotEqual(t, inspect.StepAlternate, st.Kind)
	}
}
