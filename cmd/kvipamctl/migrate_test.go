package main

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/inspect"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/allocator/schema"
)

// TestIPMigrateCutOver: during a live migration ip show and claim show
// name the target as the second owner; ip migrate --cut-over makes it the
// owner (the source its second owner), and IP history records the
// source's interval as ended by the migration, as an agent's cut-over
// does; run again, it swaps them back; without --cut-over, or with no
// migration in progress, it is refused.
func TestIPMigrateCutOver(t *testing.T) {
	ctx := context.Background()
	h := newHarness(t)
	h.withSmallPool()
	n1, n2 := h.agent("n1"), h.agent("n2")
	// Both agents know migration-owner: the level the agents raise
	// (agent.schemaRaiser), raised by hand here.
	_, _, err := etcdstore.New(h.cli, etcdstore.Options{}).RaiseSchema(ctx, schema.Highest(), "n1", "test")
	require.NoError(t, err)
	sticky := &records.Sticky{Identity: "vms/vm1", Window: time.Hour}
	source := records.Owner{ContainerID: "src", IfName: "eth0", Namespace: "vms", Pod: "virt-launcher-vm1-a", PodUID: "u1"}
	target := records.Owner{ContainerID: "dst", IfName: "eth0", Namespace: "vms", Pod: "virt-launcher-vm1-b", PodUID: "u2"}
	res, err := n1.Alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: source, Sticky: sticky})
	require.NoError(t, err)
	x := res.Allocations[0].Addr
	code, _, errs := h.run("ip", "migrate", "vms/vm1", "--pool", "small", "--cut-over")
	require.Equal(t, exitError, code, "no migration in progress")
	require.Contains(t, errs, "no migration in progress")

	_, ok, err := n2.Alloc.Admit(ctx, nodealloc.Request{Pool: "small", Owner: target, Sticky: sticky, Migration: "kubevirt-migrate-vm1"})
	require.NoError(t, err)
	require.True(t, ok, "the target is admitted")
	var ip inspect.IP
	require.Equal(t, exitOK, h.json(&ip, "ip", "show", x.String()))
	require.Equal(t, source.Key(), ip.Owner.Key())
	require.NotNil(t, ip.Alternate)
	require.Equal(t, target.Key(), ip.Alternate.Owner.Key())
	require.Equal(t, "n2", ip.Alternate.Node)
	require.Contains(t, h.ok("claim", "show", "vms/vm1", "--pool", "small"), `vms/virt-launcher-vm1-b (dst/eth0) on n2, migration "kubevirt-migrate-vm1"`)

	code, _, errs = h.run("ip", "migrate", "vms/vm1", "--pool", "small")
	require.Equal(t, exitError, code)
	require.Contains(t, errs, "--cut-over")
	require.Contains(t, h.ok("ip", "migrate", "vms/vm1", "--pool", "small", "--cut-over"), "cut over to dst/eth0 on node n2")
	require.Equal(t, exitOK, h.json(&ip, "ip", "show", x.String()))
	require.Equal(t, target.Key(), ip.Owner.Key(), "the target forwards")
	require.Equal(t, "n2", ip.Node)
	require.NotNil(t, ip.Alternate)
	require.Equal(t, source.Key(), ip.Alternate.Owner.Key(), "the source is the second owner until its DEL")

	var rows []historyRow
	require.Equal(t, exitOK, h.json(&rows, "ip", "history", x.String()))
	require.Len(t, rows, 3, "the source's interval ended by the cut-over, the target's open, the source's open as second owner: %+v", rows)
	require.Equal(t, source.ContainerID, rows[0].ContainerID)
	require.Equal(t, etcdstore.EndMigrated, rows[0].Reason)
	require.Equal(t, "n1", rows[0].Node)
	require.Equal(t, target.ContainerID, rows[1].ContainerID)
	require.True(t, rows[1].Current)
	require.False(t, rows[1].Alternate)
	require.Equal(t, source.ContainerID, rows[2].ContainerID)
	require.True(t, rows[2].Current && rows[2].Alternate, "the source is the second owner now")

	// Run again while the source pod lives, it swaps them back
	// (docs/kvipamctl.md says so).
	require.Contains(t, h.ok("ip", "migrate", "vms/vm1", "--pool", "small", "--cut-over"), "cut over to src/eth0 on node n1")
	require.Equal(t, exitOK, h.json(&ip, "ip", "show", x.String()))
	require.Equal(t, source.Key(), ip.Owner.Key())
	require.Equal(t, target.Key(), ip.Alternate.Owner.Key())
}
