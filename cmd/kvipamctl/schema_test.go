package main

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/schema"
	"github.com/kvipam/kvipam/internal/testsupport/agenttest"
)

// TestSchemaCommands: kvipamctl version shows the cluster's schema level
// and each node's; pool set-max-blocks is refused, naming the node, while
// a node of level 1 lives; check reports a node below the level; and
// downgrade validate/enable refuse a level in use, naming the pool, and
// hold the level once it is not; cancel lets it go.
func TestSchemaCommands(t *testing.T) {
	h := newHarness(t)
	h.withSmallPool()
	h.agent("n1")
	old := agenttest.Start(t, h.e, "n0", agenttest.Options{Pools: []string{"small"}, Older: true})
	st := etcdstore.New(h.cli, etcdstore.Options{})
	ctx := context.Background()

	var v versionInfo
	require.Equal(t, exitOK, h.json(&v, "version"))
	require.NotNil(t, v.Cluster)
	require.Equal(t, schema.Base, v.Cluster.Level)
	require.Equal(t, []nodeVersion{{Name: "n0", Version: "v0.1.0", Level: 1}, {Name: "n1", Version: "unknown", Level: schema.Highest(), Features: schema.Names()}}, v.Cluster.Nodes)
	code, out, errs := h.run("pool", "set-max-blocks", "small", "2")
	require.Equal(t, exitError, code, out)
	require.Contains(t, errs, "n0 (v0.1.0, level 1)")
	code, _, errs = h.run("pool", "set-max-blocks", "small", "two")
	require.Equal(t, exitError, code)
	require.Contains(t, errs, `max blocks "two": want a number above 0, or none`)

	// The agents raise the level once n0 is gone (agent.schemaRaiser;
	// done by hand here), and set-max-blocks is accepted.
	old.Kill(t)
	_, raised, err := st.RaiseSchema(ctx, schema.Highest(), "n1", "test")
	require.NoError(t, err)
	require.True(t, raised)
	require.Contains(t, h.ok("pool", "set-max-blocks", "small", "2"), "max blocks per node 2")
	require.Contains(t, h.ok("version"), "cluster schema level")

	// A node of level 1 started anyway (against the procedure): check
	// says so.
	agenttest.Start(t, h.e, "n2", agenttest.Options{Pools: []string{"small"}, Older: true})
	code, out, _ = h.run("check")
	require.Equal(t, exitFindings, code, out)
	require.Contains(t, out, "below-schema")
	require.Contains(t, out, "node n2 runs v0.1.0")

	code, _, errs = h.run("downgrade", "validate", "v0.1.0")
	require.Equal(t, exitError, code)
	require.Contains(t, errs, "pool small uses pool-max-blocks (level 2)")
	code, _, errs = h.run("downgrade", "enable", "v0.1.0")
	require.Equal(t, exitError, code)
	require.Contains(t, errs, "pool small uses pool-max-blocks (level 2)")
	code, _, errs = h.run("downgrade", "enable", "v0.0.1")
	require.Equal(t, exitError, code)
	require.Contains(t, errs, "predates kvipam's first release v0.1.0")
	h.ok("pool", "set-max-blocks", "small", "none")
	require.Contains(t, h.ok("downgrade", "validate", "v0.1.0"), "can go down to level 1")
	require.Contains(t, h.ok("downgrade", "enable", "v0.1.0"), "schema level 1, held for a downgrade to v0.1.0")
	require.Equal(t, exitOK, h.json(&v, "version"))
	require.Equal(t, schema.Base, v.Cluster.Level)
	require.True(t, v.Cluster.Downgrade)
	require.Contains(t, h.ok("check"), "no problems found")
	require.Contains(t, h.ok("downgrade", "cancel"), "no longer held")
	require.Contains(t, h.ok("downgrade", "cancel"), "no downgrade holds")
	code, _, errs = h.run("downgrade", "frobnicate")
	require.Equal(t, exitError, code)
	require.Contains(t, errs, "unknown command")
}
