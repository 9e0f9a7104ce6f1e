package main

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/internal/testsupport/agenttest"
)

// TestPoolSelectCommands: pool create --node-selector and pool select
// set a pool's node selector; pool show lists the live nodes that serve
// it now, from the labels in their node records; pool bind-namespace and
// pool select warn, naming the pool and its selector, when no live node
// serves it; a bad selector is refused, naming the term.
func TestPoolSelectCommands(t *testing.T) {
	h := newHarness(t)
	var p allocator.Pool
	require.Equal(t, exitOK, h.json(&p, "pool", "create", "rack-r1", "--cidr", "10.30.0.0/24", "--node-selector", "rack=r1"))
	require.Equal(t, "rack=r1", p.NodeSelector)
	h.ok("pool", "create", "shared", "--cidr", "10.31.0.0/24")
	agenttest.Start(t, h.e, "n1", agenttest.Options{Labels: map[string]string{"rack": "r1"}})
	agenttest.Start(t, h.e, "n2", agenttest.Options{Labels: map[string]string{"rack": "r2"}})

	var d poolDetail
	require.Equal(t, exitOK, h.json(&d, "pool", "show", "rack-r1"))
	require.Equal(t, []string{"n1"}, d.Nodes)
	require.Equal(t, exitOK, h.json(&d, "pool", "show", "shared"))
	require.Equal(t, []string{"n1", "n2"}, d.Nodes, "no selector: every node")
	out := h.ok("pool", "show", "rack-r1")
	require.Contains(t, out, `Node selector:  "rack=r1"`)
	require.Contains(t, out, "Serving nodes:  n1")
	h.ok("pool", "create", "rack-r1", "--cidr", "10.30.0.0/24")
	require.Equal(t, exitOK, h.json(&d, "pool", "show", "rack-r1"))
	require.Equal(t, "rack=r1", d.Pool.NodeSelector, "create again without a selector keeps it")

	code, out, errs := h.run("pool", "select", "rack-r1", "rack=r3")
	require.Equal(t, exitOK, code)
	require.Contains(t, out, `pool rack-r1: node selector "rack=r3"`)
	require.Contains(t, errs, `warning: no live node serves pool rack-r1 (node selector "rack=r3")`)
	code, out, errs = h.run("pool", "bind-namespace", "payments", "rack-r1")
	require.Equal(t, exitOK, code)
	require.Contains(t, out, "namespace payments: pool rack-r1")
	require.Contains(t, errs, `warning: no live node serves pool rack-r1 (node selector "rack=r3"); pods of namespace payments fail until one does`)
	require.Equal(t, exitOK, h.json(&d, "pool", "show", "rack-r1"))
	require.Empty(t, d.Nodes)
	require.Contains(t, h.ok("pool", "show", "rack-r1"), "Serving nodes:  none")

	code, _, errs = h.run("pool", "select", "rack-r1", "rack in (r1)")
	require.Equal(t, exitError, code)
	require.Contains(t, errs, `invalid node selector: term "rack in (r1)"`)
	require.Contains(t, h.ok("pool", "select", "rack-r1", ""), "pool rack-r1: node selector (every node)")
	require.Equal(t, exitOK, h.json(&d, "pool", "show", "rack-r1"))
	require.Equal(t, []string{"n1", "n2"}, d.Nodes)
}
