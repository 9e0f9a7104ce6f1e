package inspect_test

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/inspect"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/allocator/schema"
	"github.com/kvipam/kvipam/internal/foundation/retry"
)

func TestNodeRemoveFreesOrphanedBlocks(t *testing.T) {
	ctx := t.Context()
	v := newEnv(t)
	n1 := startAgent(t, v.e, "n1", 0)
	held := allocate(t, n1, 0, 20, false)
	n1Blocks := map[netip.Prefix]bool{}
	for _, al := range held {
		n1Blocks[al.Block] = true
	}
	require.Len(t, n1Blocks, 2)
	n1.Kill(t)

	// n2 fills the rest of the pool; n1's blocks stay out of its reach.
	n2 := startAgent(t, v.e, "n2", 0)
	for i := 1000; ; i++ {
		_, err := n2.Alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(i)})
		var ee *records.ExhaustedError
		if err != nil {
			require.ErrorAs(t, err, &ee)
			require.Equal(t, 2, ee.Orphaned)
			break
		}
	}
	r := v.check(t)
	require.Equal(t, map[inspect.Kind]bool{inspect.KindOrphanedBlock: true}, kinds(r))
	require.Len(t, r.Findings, 2)

	before := v.snapshot(t)
	p, err := inspect.PlanNodeRemove(before, "n1", gone("n1"), false)
	require.NoError(t, err)
	var kindsInOrder []string
	for _, st := range p.Steps {
		require.True(t, n1Blocks[st.Block], "only n1's blocks are touched: %+v", st)
		require.NotEmpty(t, st.Group)
		kindsInOrder = append(kindsInOrder, string(st.Kind))
	}
	require.Len(t, p.Steps, 22, "20 addresses and 2 homes")
	require.Equal(t, "home", kindsInOrder[len(kindsInOrder)-1], "a home goes after its block's addresses")
	require.Equal(t, before.Revision, v.snapshot(t).Revision, "planning (a dry run) writes nothing")

	log, buf := auditLog()
	res, err := v.in.Execute(ctx, p, log)
	require.NoError(t, err)
	require.Equal(t, 22, res.Deleted)
	require.Equal(t, 22, strings.Count(buf.String(), "deleted key"))
	require.Empty(t, v.check(t).Findings, "nothing orphaned is left")

	// The freed blocks are claimable again, by another node.
	got := map[netip.Prefix]int{}
	for i := 2000; i < 2030; i++ {
		res, err := n2.Alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(i)})
		require.NoError(t, err)
		got[res.Allocations[0].Block]++
	}
	for b := range n1Blocks {
		require.Positive(t, got[b], "n2 allocates from n1's former block %s", b)
	}
	require.Empty(t, v.check(t).Findings)
}

func TestNodeRemoveDeadNodeClaim(t *testing.T) {
	v := newEnv(t)
	blk := netip.MustParsePrefix("10.20.0.64/28")
	// As an operator might find it: a claim on a live lease (an agent that
	// lost its node record, or a hand edit), a home and two addresses.
	v.put(t, etcdstore.ClaimKey("small", blk), records.Claim{Node: "ghost"}, clientv3.WithLease(v.lease(t)))
	v.put(t, etcdstore.HomeKey("small", blk), records.Home{Node: "ghost"})
	for i := 1; i <= 2; i++ {
		v.put(t, etcdstore.IPKey("small", blk, addrAt(t, blk, i)), record(owner(i), "ghost", records.StateAllocated))
	}
	// And an empty block that still has ghost's claim and home.
	empty := netip.MustParsePrefix("10.20.0.80/28")
	v.put(t, etcdstore.ClaimKey("small", empty), records.Claim{Node: "ghost"}, clientv3.WithLease(v.lease(t)))
	v.put(t, etcdstore.HomeKey("small", empty), records.Home{Node: "ghost"})
	require.Equal(t, map[inspect.Kind]bool{inspect.KindDeadNodeClaim: true}, kinds(v.check(t)))

	p, err := inspect.PlanNodeRemove(v.snapshot(t), "ghost", gone("ghost"), false)
	require.NoError(t, err)
	var order []string
	for _, st := range p.Steps {
		order = append(order, string(st.Kind)+" "+st.Block.String())
	}
	require.Equal(t, []string{
		"claim 10.20.0.64/28", "ip 10.20.0.64/28", "ip 10.20.0.64/28", "home 10.20.0.64/28",
		"claim 10.20.0.80/28", "home 10.20.0.80/28",
	}, order)
	_, err = v.in.Execute(t.Context(), p, nil)
	require.NoError(t, err)
	require.Zero(t, v.count(t, etcdstore.AllClaimsPrefix()))
	require.Zero(t, v.count(t, etcdstore.AllHomesPrefix()))
	require.Zero(t, v.count(t, etcdstore.AllIPsPrefix()))
	require.Empty(t, v.check(t).Findings)
}

func TestNodeRemoveFencedWhenNodeReturns(t *testing.T) {
	v := newEnv(t)
	n1 := startAgent(t, v.e, "n1", 0)
	held := allocate(t, n1, 0, 5, false)
	n1.Kill(t)
	p, err := inspect.PlanNodeRemove(v.snapshot(t), "n1", gone("n1"), false)
	require.NoError(t, err)
	require.Len(t, p.Steps, 6)

	// n1 restarts between plan and execution and re-claims its block.
	n1b := startAgent(t, v.e, "n1", 0)
	res, err := v.in.Execute(t.Context(), p, nil)
	require.ErrorIs(t, err, retry.ErrConflict)
	require.Zero(t, res.Deleted)
	require.Equal(t, 1, res.Failed, "the first address fails its fence")
	require.Equal(t, 5, res.Skipped, "and the rest of the block is skipped")
	require.Equal(t, int64(5), v.count(t, etcdstore.IPsPrefix("small")))
	for i, al := range held {
		got := n1b.Alloc.Lookup(owner(i))
		require.Len(t, got, 1)
		require.Equal(t, al.Addr, got[0].Addr)
	}
	require.Empty(t, v.check(t).Findings)
}

func TestNodeRemoveRefusesOtherLiveNodesAddresses(t *testing.T) {
	v := newEnv(t)
	n2 := startAgent(t, v.e, "n2", 0)
	blk := netip.MustParsePrefix("10.20.0.64/28")
	v.put(t, etcdstore.HomeKey("small", blk), records.Home{Node: "ghost"})
	v.put(t, etcdstore.IPKey("small", blk, addrAt(t, blk, 1)), record(owner(1), "ghost", records.StateAllocated))
	v.put(t, etcdstore.IPKey("small", blk, addrAt(t, blk, 2)), record(owner(2), n2.Name, records.StateAllocated))
	_, err := inspect.PlanNodeRemove(v.snapshot(t), "ghost", gone("ghost"), false)
	require.ErrorIs(t, err, inspect.ErrNodeAlive)
	require.ErrorContains(t, err, "other nodes")
	p, err := inspect.PlanNodeRemove(v.snapshot(t), "ghost", gone("ghost"), true)
	require.NoError(t, err)
	require.Len(t, p.Steps, 3)
}

// TestNodeRemoveEvidenceCrossCheck: each kind of record a node writes with
// a time is a sign of life that a stated last-seen must not precede.
func TestNodeRemoveEvidenceCrossCheck(t *testing.T) {
	lastSeen := time.Date(2026, 1, 22, 8, 0, 0, 0, time.UTC)
	later := lastSeen.Add(time.Minute)
	blk := netip.MustParsePrefix("10.20.0.64/28")
	ev := inspect.Evidence{ConfirmGone: "ghost", LastSeen: lastSeen, StatedAt: lastSeen.Add(time.Hour)}
	for _, tc := range []struct {
		name  string
		plant func(v *env)
		force bool
		key   string
	}{
		{"allocation", func(v *env) {
			rec := record(owner(1), "ghost", records.StateAllocated)
			rec.Since = later
			v.put(t, etcdstore.IPKey("small", blk, addrAt(t, blk, 1)), rec)
		}, false, etcdstore.IPKey("small", blk, addrAt(t, blk, 1))},
		{"claim", func(v *env) {
			v.put(t, etcdstore.ClaimKey("small", blk), records.Claim{Node: "ghost", ClaimedAt: later}, clientv3.WithLease(v.lease(t)))
		}, false, etcdstore.ClaimKey("small", blk)},
		{"home", func(v *env) {
			v.put(t, etcdstore.HomeKey("small", blk), records.Home{Node: "ghost", Since: later})
		}, false, etcdstore.HomeKey("small", blk)},
		{"node record, forced", func(v *env) {
			v.put(t, etcdstore.NodeKey("ghost"), etcdstore.NodeRecord{Name: "ghost", StartedAt: later}, clientv3.WithLease(v.lease(t)))
		}, true, etcdstore.NodeKey("ghost")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			v := newEnv(t)
			// An older sign of life, which the stated time does not contradict.
			v.put(t, etcdstore.HomeKey("small", netip.MustParsePrefix("10.20.0.0/28")), records.Home{Node: "ghost", Since: lastSeen.Add(-time.Hour)})
			tc.plant(v)
			_, err := inspect.PlanNodeRemove(v.snapshot(t), "ghost", ev, tc.force)
			require.ErrorIs(t, err, inspect.ErrEvidenceContradicted)
			require.ErrorContains(t, err, tc.key)
			require.ErrorContains(t, err, later.Format(time.RFC3339Nano))

			atLast := ev
			atLast.LastSeen = later
			p, err := inspect.PlanNodeRemove(v.snapshot(t), "ghost", atLast, tc.force)
			require.NoError(t, err, "last seen at the newest sign of life")
			require.Equal(t, &atLast, p.Evidence, "the plan carries the evidence")
		})
	}
	t.Run("bad evidence", func(t *testing.T) {
		s := newEnv(t).snapshot(t)
		for _, bad := range []struct {
			ev   inspect.Evidence
			want error
		}{
			{inspect.Evidence{}, inspect.ErrNoEvidence},
			{inspect.Evidence{ConfirmGone: "ghost"}, inspect.ErrNoEvidence},
			{inspect.Evidence{LastSeen: lastSeen}, inspect.ErrNoEvidence},
			{inspect.Evidence{ConfirmGone: "other", LastSeen: lastSeen}, inspect.ErrNoEvidence},
			{inspect.Evidence{ConfirmGone: "ghost", LastSeen: later, StatedAt: lastSeen}, inspect.ErrBadRequest},
		} {
			_, err := inspect.PlanNodeRemove(s, "ghost", bad.ev, true)
			require.ErrorIs(t, err, bad.want, "%+v", bad.ev)
		}
	})
}

// TestNodeRemoveReleasesKeptBinding: node remove frees an address kept
// for a sticky identity, so it frees the identity's binding too: the
// identity's next pod, on another node, gets addresses again instead of
// taking over an address whose block has no home.
func TestNodeRemoveReleasesKeptBinding(t *testing.T) {
	ctx := t.Context()
	v := newEnv(t)
	n1 := startAgent(t, v.e, "n1", 0)
	pod := func(gen int) nodealloc.Request {
		o := records.Owner{ContainerID: fmt.Sprintf("web-0-c%d", gen), IfName: "eth0", Namespace: "ns", Pod: "web-0"}
		return nodealloc.Request{Pool: "small", Owner: o, Sticky: &records.Sticky{Identity: "ns/web-0", Window: time.Hour}}
	}
	res, err := n1.Alloc.Allocate(ctx, pod(1))
	require.NoError(t, err)
	x := res.Allocations[0]
	_, err = n1.Alloc.Release(ctx, pod(1).Owner)
	require.NoError(t, err)
	bindingKey := etcdstore.BindingKey("small", "ns/web-0")
	require.True(t, v.exists(t, bindingKey), "web-0's address is kept for it")
	n1.Kill(t)

	v.removeNode(t, "n1")
	require.False(t, v.exists(t, etcdstore.IPKey("small", x.Block, x.Addr)))
	require.False(t, v.exists(t, bindingKey), "the binding goes with the kept address it names")

	// web-0's next pod, on n2, gets an address (and a binding) of its own.
	n2 := startAgent(t, v.e, "n2", 0)
	res, err = n2.Alloc.Allocate(ctx, pod(2))
	require.NoError(t, err)
	require.Len(t, res.Allocations, 1)
	b, ok, err := n2.Store.GetBinding(ctx, "small", "ns/web-0")
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, pod(2).Owner.Key(), b.Owner.Key())
	require.Equal(t, []netip.Addr{res.Allocations[0].Addr}, b.Addrs)

	// A borrowed write into a block with no home (released meanwhile) is
	// fenced out of that block, not refused as an address taken: the
	// allocator re-plans a taken address at once, and would do so until
	// its deadline.
	// An operator's release of a kept address takes its binding too, and
	// only once the address is gone.
	t.Run("release of a kept address", func(t *testing.T) {
		web1 := func(gen int) nodealloc.Request {
			r := pod(gen)
			r.Owner.ContainerID, r.Owner.Pod, r.Sticky.Identity = fmt.Sprintf("web-1-c%d", gen), "web-1", "ns/web-1"
			return r
		}
		res, err := n2.Alloc.Allocate(ctx, web1(1))
		require.NoError(t, err)
		y := res.Allocations[0]
		_, err = n2.Alloc.Release(ctx, web1(1).Owner)
		require.NoError(t, err)
		key := etcdstore.BindingKey("small", "ns/web-1")
		ipKey := etcdstore.IPKey("small", y.Block, y.Addr)
		plan := func() inspect.Plan {
			t.Helper()
			p, err := inspect.PlanReleaseIP(v.snapshot(t), "small", y.Addr, inspect.Evidence{}, true) // n2 is alive
			require.NoError(t, err)
			require.Len(t, p.Steps, 2)
			require.Equal(t, inspect.StepBinding, p.Steps[1].Kind)
			require.Equal(t, key, p.Steps[1].Key)
			require.Equal(t, []inspect.Guard{{Key: ipKey}}, p.Steps[1].Guards)
			return p
		}
		// The kept record changes after the plan: neither goes.
		p := plan()
		resp, err := v.cli.Get(ctx, ipKey)
		require.NoError(t, err)
		v.put(t, ipKey, string(resp.Kvs[0].Value), clientv3.WithIgnoreLease())
		_, err = v.in.Execute(ctx, p, nil)
		require.ErrorIs(t, err, retry.ErrConflict)
		require.True(t, v.exists(t, key), "the binding stays while its address does")
		_, err = v.in.Execute(ctx, plan(), nil)
		require.NoError(t, err)
		require.False(t, v.exists(t, ipKey))
		require.False(t, v.exists(t, key))
	})

	blk := freeBlock(t, v.snapshot(t))
	lost := addrAt(t, blk, 1)
	t.Run("homeless block is fenced", func(t *testing.T) {
		fence, err := n2.Store.FenceBorrower(ctx, records.Claim{Node: "n2", ClaimedAt: time.Now().UTC()}, n2.Session.ID())
		require.NoError(t, err)
		w := records.IPWrite{Pool: "small", Block: blk, Addr: lost, ClaimRev: fence, Borrowed: true,
			Record: records.Record{Owner: pod(3).Owner, Node: "n2", State: records.StateAllocated, Since: time.Now().UTC(), Borrowed: true}}
		_, err = n2.Store.WriteIPs(ctx, []records.IPWrite{w})
		var we *records.WriteError
		require.ErrorAs(t, err, &we)
		require.Empty(t, we.Taken, "nobody holds the address")
		require.Equal(t, []netip.Prefix{blk}, we.Fenced)
	})
	// A binding left behind by hand (or by a node remove of an older
	// kvipamctl) that names an address of a released block: the
	// identity's next pod is refused after the allocator's bounded
	// retries, instead of re-sending its write until the request's
	// deadline. (The deadline only ends the old loop; the test does not
	// wait for it.)
	t.Run("stale binding is refused, not retried until the deadline", func(t *testing.T) {
		v.put(t, etcdstore.BindingKey("small", "ns/web-9"), records.Binding{Identity: "ns/web-9", Addrs: []netip.Addr{lost},
			Since: time.Now().UTC(), WindowSeconds: 3600})
		o := records.Owner{ContainerID: "web-9-c1", IfName: "eth0", Namespace: "ns", Pod: "web-9"}
		actx, cancel := context.WithTimeout(ctx, 5*time.Minute)
		defer cancel()
		_, err := n2.Alloc.Allocate(actx, nodealloc.Request{Pool: "small", Owner: o, Sticky: &records.Sticky{Identity: "ns/web-9", Window: time.Hour}})
		var we *records.WriteError
		require.ErrorAs(t, err, &we)
		require.Equal(t, []netip.Prefix{blk}, we.Fenced)
		require.NoError(t, actx.Err())
	})
}

// TestReleaseAgainDeletesStaleBinding: an operator's release of a sticky
// pod deletes its address, and the binding step fails (etcd unavailable
// for that one transaction). Run again, the plan finds no address of the
// pod any more; it must still delete the binding that names the pod and
// none of whose addresses the pod holds, or the binding outlives the
// release naming a container that holds nothing.
func TestReleaseAgainDeletesStaleBinding(t *testing.T) {
	ctx := t.Context()
	v := newEnv(t)
	n1 := startAgent(t, v.e, "n1", 0)
	o := records.Owner{ContainerID: "web-0-c1", IfName: "eth0", Namespace: "ns", Pod: "web-0"}
	_, err := n1.Alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: o, Sticky: &records.Sticky{Identity: "ns/web-0", Window: time.Hour}})
	require.NoError(t, err)
	bindingKey := etcdstore.BindingKey("small", "ns/web-0")
	n1.Kill(t)

	p, err := inspect.PlanReleaseOwner(v.snapshot(t), o.ContainerID, "", gone("n1"), false)
	require.NoError(t, err)
	var ipSteps []inspect.Step
	for _, st := range p.Steps {
		if st.Kind == inspect.StepIP {
			ipSteps = append(ipSteps, st)
		}
	}
	require.NotEmpty(t, ipSteps)
	p.Steps = ipSteps // the binding step did not run (its transaction failed)
	_, err = v.in.Execute(ctx, p, nil)
	require.NoError(t, err)
	require.True(t, v.exists(t, bindingKey))

	again, err := inspect.PlanReleaseOwner(v.snapshot(t), o.ContainerID, "", gone("n1"), false)
	require.NoError(t, err)
	_, err = v.in.Execute(ctx, again, nil)
	require.NoError(t, err)
	require.False(t, v.exists(t, bindingKey), "the binding of the released pod goes on the second run")
}

// TestNodeRemoveReleasesIdentityWhole: web-0's pod on n1 held x in n1's
// block and z borrowed from n2's; its DEL kept both for the identity.
// node remove n1 frees x, so it frees the binding; it must free z too
// (kept for the identity by n1, lent in n2's block), or the identity's
// next pod gets new addresses while etcd still keeps z for it.
func TestNodeRemoveReleasesIdentityWhole(t *testing.T) {
	ctx := t.Context()
	v := newEnv(t)
	n1 := startAgent(t, v.e, "n1", 0)
	n2 := startAgent(t, v.e, "n2", 0)
	o := records.Owner{ContainerID: "web-0-c1", IfName: "eth0", Namespace: "ns", Pod: "web-0"}
	res, err := n1.Alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: o, Sticky: &records.Sticky{Identity: "ns/web-0", Window: time.Hour}})
	require.NoError(t, err)
	x := res.Allocations[0]
	_, err = n1.Alloc.Release(ctx, o)
	require.NoError(t, err)
	other := allocate(t, n2, 100, 1, false)[0] // n2 claims a block
	require.NotEqual(t, x.Block, other.Block)

	// z: kept for web-0 in n2's block, written by n1 (borrowed), and named
	// by the binding beside x.
	z := addrAt(t, other.Block, 5)
	zKey := etcdstore.IPKey("small", other.Block, z)
	kept := record(o, "n1", records.StateKept)
	kept.Identity, kept.WindowSeconds, kept.Borrowed = "ns/web-0", 3600, true
	v.put(t, zKey, kept)
	v.put(t, etcdstore.LentKey("small", z), records.Home{Node: "n1", Since: kept.Since})
	bindingKey := etcdstore.BindingKey("small", "ns/web-0")
	b, ok, err := n1.Store.GetBinding(ctx, "small", "ns/web-0")
	require.NoError(t, err)
	require.True(t, ok)
	b.Addrs = append(b.Addrs, z)
	v.put(t, bindingKey, b)
	n1.Kill(t)

	v.removeNode(t, "n1")
	require.False(t, v.exists(t, etcdstore.IPKey("small", x.Block, x.Addr)))
	require.False(t, v.exists(t, bindingKey), "the binding goes with the kept address it names")
	require.False(t, v.exists(t, zKey), "the identity's other kept address goes with its binding")
	require.False(t, v.exists(t, etcdstore.LentKey("small", z)))
	require.True(t, v.exists(t, etcdstore.IPKey("small", other.Block, other.Addr)), "n2's own pod keeps its address")
}

// TestNodeRemoveRefusesLiveMigrationTarget: the node of a VM's source pod
// is gone, its target pod runs on another, live node as the migration's
// second owner: node remove (and release of the address) would free the
// address under the running target. Refused, naming it, until the
// migration is cut over; forced, it goes.
func TestNodeRemoveRefusesLiveMigrationTarget(t *testing.T) {
	ctx := t.Context()
	v := newEnv(t)
	n1 := startAgent(t, v.e, "n1", 0)
	n2 := startAgent(t, v.e, "n2", 0)
	_, _, err := n2.Store.RaiseSchema(ctx, schema.Highest(), "n2", "test")
	require.NoError(t, err)
	vm := func(gen, migration string) nodealloc.Request {
		o := records.Owner{ContainerID: "launcher-" + gen, IfName: "eth0", Namespace: "ns", Pod: "virt-launcher-vm1-" + gen}
		return nodealloc.Request{Pool: "small", Owner: o, Sticky: &records.Sticky{Identity: "ns/vm1", Window: time.Hour}, Migration: migration}
	}
	res, err := n1.Alloc.Allocate(ctx, vm("src", ""))
	require.NoError(t, err)
	x := res.Allocations[0].Addr
	_, ok, err := n2.Alloc.Admit(ctx, vm("dst", "job"))
	require.NoError(t, err)
	require.True(t, ok)
	n1.Kill(t)

	s := v.snapshot(t)
	_, err = inspect.PlanNodeRemove(s, "n1", gone("n1"), false)
	require.ErrorIs(t, err, inspect.ErrNodeAlive)
	require.ErrorContains(t, err, x.String())
	require.ErrorContains(t, err, "kvipamctl ip migrate")
	_, err = inspect.PlanReleaseIP(s, "small", x, gone("n1"), false)
	require.ErrorIs(t, err, inspect.ErrNodeAlive, "releasing the address alone is refused too")

	// Cut over to the target: the address is n2's now, node remove
	// leaves it alone.
	require.NoError(t, n2.Alloc.CutOver(ctx, "small", "ns/vm1", vm("dst", "").Owner))
	p, err := inspect.PlanNodeRemove(v.snapshot(t), "n1", gone("n1"), false)
	require.NoError(t, err)
	for _, st := range p.Steps {
		require.NotEqual(t, x, st.Addr, "the target's address is not removed: %+v", st)
	}
}
