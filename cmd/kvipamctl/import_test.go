package main

import (
	"context"
	"net/netip"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/allocator/schema"
	"github.com/kvipam/kvipam/internal/testsupport/agenttest"
)

// TestImportWhereaboutsFile imports whereabouts' allocations from a
// kubectl export (allocator/adopt/whereabouts/testdata) into a pool of
// /24 blocks, where pods of two nodes share a block: the node with the
// lower name of a tie claims it, the other's address is borrowed (with
// its home, under its fence); the IPv6 one is claimed for its node. The
// dry run writes nothing, a second run writes nothing, the agents learn
// the import from their marks, a DEL frees the borrowed address with
// its home, check is clean, and finalize drops the marks.
func TestImportWhereaboutsFile(t *testing.T) {
	ctx := context.Background()
	h := newHarness(t)
	h.ok("pool", "create", "lan", "--cidr", "10.5.0.0/24", "--cidr", "fd00:5::/120", "--block-size-v4", "24", "--block-size-v6", "122")
	opts := agenttest.Options{Pools: []string{"lan"}}
	n1, n2 := agenttest.Start(t, h.e, "node-1", opts), agenttest.Start(t, h.e, "node-2", opts)
	export := "../../allocator/adopt/whereabouts/testdata/export.json"
	args := []string{"import", "whereabouts", "--pool", "lan", "--file", export}

	code, _, errs := h.run(args...)
	require.Equal(t, exitError, code)
	require.Contains(t, errs, "schema level", "refused below level 4: "+errs)
	_, _, err := etcdstore.New(h.cli, etcdstore.Options{}).RaiseSchema(ctx, schema.Highest(), "node-1", "test")
	require.NoError(t, err)

	var plan importResult
	require.Equal(t, exitOK, h.json(&plan, append(args, "--dry-run")...))
	require.True(t, plan.DryRun)
	require.Len(t, plan.Blocks, 2)
	require.Len(t, plan.Skipped, 3)
	require.Zero(t, h.count(etcdstore.AllIPsPrefix()), "a dry run writes nothing")

	var res importResult
	require.Equal(t, exitOK, h.json(&res, args...))
	require.Equal(t, 2, res.Written)
	v4 := netip.MustParsePrefix("10.5.0.0/24")
	infos, err := n1.Store.GetBlocks(ctx, "lan", []netip.Prefix{v4})
	require.NoError(t, err)
	require.True(t, infos[v4].Owned("node-1"), "the tie goes to node-1")
	require.Equal(t, n1.Session.ID(), infos[v4].ClaimLease, "on node-1's live lease")
	got, err := n1.Store.GetIPs(ctx, []records.IPRef{{Pool: "lan", Block: v4, Addr: netip.MustParseAddr("10.5.0.1")}, {Pool: "lan", Block: v4, Addr: netip.MustParseAddr("10.5.0.65")}})
	require.NoError(t, err)
	web0, db0 := got[netip.MustParseAddr("10.5.0.1")], got[netip.MustParseAddr("10.5.0.65")]
	require.Equal(t, "3b1f0c2a9d/net1", web0.Owner.Key())
	require.Equal(t, "default", web0.Namespace)
	require.Equal(t, "web-0", web0.Pod)
	require.Equal(t, "whereabouts:lan", web0.Imported)
	require.False(t, web0.Borrowed)
	require.Equal(t, "node-2", db0.Node)
	require.True(t, db0.Borrowed, "node-2's pod in node-1's block")
	lent, err := n1.Store.ListLent(ctx, "lan")
	require.NoError(t, err)
	require.Equal(t, map[netip.Addr]string{netip.MustParseAddr("10.5.0.65"): "node-2"}, lent)

	require.Equal(t, exitOK, h.json(&res, args...))
	require.Zero(t, res.Written, "imported already: nothing written")

	marks, err := n1.Store.ListImportMarks(ctx)
	require.NoError(t, err)
	require.Len(t, marks, 3)
	for _, m := range marks {
		a := map[string]*agenttest.Agent{"node-1": n1, "node-2": n2}[m.Node]
		require.NoError(t, a.Alloc.LearnImport(ctx, m))
	}
	held := func(a *agenttest.Agent, o records.Owner) []records.Allocation { return a.Alloc.Lookup(o) }
	require.Len(t, held(n1, web0.Owner), 1, "node-1 learned web-0's IPv4 address")
	require.Len(t, held(n2, db0.Owner), 1, "node-2 learned its borrowed address")

	code, out, errs := h.run("check")
	require.Equal(t, exitOK, code, "check: %s %s", out, errs)
	rel, err := n2.Alloc.Release(ctx, db0.Owner)
	require.NoError(t, err)
	require.Len(t, rel, 1)
	lent, err = n1.Store.ListLent(ctx, "lan")
	require.NoError(t, err)
	require.Empty(t, lent, "the borrowed address's home went with it")

	require.Contains(t, h.ok("import", "status"), "whereabouts:lan")
	h.ok("import", "finalize", "whereabouts:lan")
	marks, err = n1.Store.ListImportMarks(ctx)
	require.NoError(t, err)
	require.Empty(t, marks)
	require.Contains(t, h.ok("import", "status", "-o", "json"), `"finalized": true`)
}
