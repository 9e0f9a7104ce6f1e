package main

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
)

// TestClaimCommands: a sticky identity shows in claim list and show
// while its pod holds it and while it is kept; claim release is refused
// while the pod holds it and frees the kept addresses after; pool show
// counts them; check flags a binding whose address another owner holds.
func TestClaimCommands(t *testing.T) {
	ctx := context.Background()
	h := newHarness(t)
	h.withSmallPool()
	n1 := h.agent("n1")
	pod := records.Owner{ContainerID: "c1", IfName: "eth0", Namespace: "db", Pod: "pg-0", PodUID: "u1"}
	req := nodealloc.Request{Pool: "small", Owner: pod, Sticky: &records.Sticky{Identity: "db/pg-0", Window: time.Hour}}
	res, err := n1.Alloc.Allocate(ctx, req)
	require.NoError(t, err)
	x := res.Allocations[0].Addr

	var rows []bindingRow
	require.Equal(t, exitOK, h.json(&rows, "claim", "list"))
	require.Len(t, rows, 1)
	require.Equal(t, "db/pg-0", rows[0].Identity)
	require.Equal(t, pod.Key(), rows[0].Holder)
	code, _, errs := h.run("claim", "release", "db/pg-0", "--pool", "small")
	require.Equal(t, exitError, code)
	require.Contains(t, errs, "held by c1/eth0 on node n1")

	_, err = n1.Alloc.Release(ctx, pod)
	require.NoError(t, err)
	out := h.ok("claim", "show", "db/pg-0", "--pool", "small")
	require.Contains(t, out, x.String())
	require.Contains(t, out, "1h0m0s")
	var d poolDetail
	require.Equal(t, exitOK, h.json(&d, "pool", "show", "small"))
	require.Equal(t, 1, d.Usage[0].Kept)
	require.Equal(t, 1, d.Usage[0].Bindings)
	require.Len(t, d.Sticky, 1)
	require.Contains(t, h.ok("pool", "show", "small"), "db/pg-0")
	require.Equal(t, exitOK, h.json(&struct{}{}, "check"), "a kept identity is no finding")

	require.Contains(t, h.ok("claim", "release", "db/pg-0", "--pool", "small"), "released ["+x.String()+"]")
	require.Equal(t, exitOK, h.json(&rows, "claim", "list"))
	require.Empty(t, rows)
	require.Zero(t, h.count(etcdstore.IPsPrefix("small")), "the kept address is free again")

	// A binding naming an address another owner holds is a finding.
	y := n1.Allocate(t, "small", 0, 1, false)[0].Addr
	h.put(etcdstore.BindingKey("small", "db/ghost"), records.Binding{Identity: "db/ghost", Addrs: []netip.Addr{y}, WindowSeconds: 60})
	code, out, _ = h.run("check")
	require.NotEqual(t, exitOK, code)
	require.Contains(t, out, "sticky-conflict")
	require.Contains(t, out, "sticky identity db/ghost names "+y.String())
}
