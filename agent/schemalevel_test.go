package agent

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/schema"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// olderAgent builds an agent that understands only schema level 1 and
// advertises no features: kvipam v0.1.0's node record, or a later
// release's before the features it lacks.
func olderAgent(t *testing.T, cfg Config) *Agent {
	t.Helper()
	a, err := New(cfg, Options{Version: "v0.1.9"})
	require.NoError(t, err)
	a.knows = schemaKnowledge{highest: schema.Base}
	return a
}

// awaitLevel waits, on a watch of the schema key, until the cluster's
// level is want (the test's deadline bounds it).
func awaitLevel(t *testing.T, cli *clientv3.Client, st *etcdstore.Store, want schema.Level) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	wch := cli.Watch(ctx, etcdstore.SchemaKey())
	cur, err := st.ReadSchema(ctx)
	require.NoError(t, err)
	for cur.Level != want {
		select {
		case <-wch:
		case <-ctx.Done():
			t.Fatalf("the cluster's schema level stayed %d, want %d", cur.Level, want)
		}
		cur, err = st.ReadSchema(ctx)
		require.NoError(t, err)
	}
}

// TestNewerSchemaRefusedAtStart: an agent that meets a schema level above
// its own refuses to start, naming both versions and levels, and writes
// nothing: no node record, no pool, no claim.
func TestNewerSchemaRefusedAtStart(t *testing.T) {
	e := etcdtest.Start(t)
	cli := etcdtest.Client(t, e)
	ctx := context.Background()
	newer, err := json.Marshal(etcdstore.SchemaSetting{Level: schema.Highest() + 1, By: "node-9", Version: "v9.9.9", At: time.Now().UTC()})
	require.NoError(t, err)
	_, err = cli.Put(ctx, etcdstore.SchemaKey(), string(newer))
	require.NoError(t, err)
	before, err := cli.Get(ctx, etcdstore.Prefix, clientv3.WithPrefix())
	require.NoError(t, err)

	a, err := New(testConfig(t, e), Options{Version: "v0.2.0-test"})
	require.NoError(t, err)
	rctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	err = a.Run(rctx, nil)
	require.ErrorIs(t, err, etcdstore.ErrSchemaLevel)
	for _, want := range []string{"refusing to start", fmt.Sprintf("level %d", schema.Highest()+1), "v9.9.9", "node-9", "v0.2.0-test",
		fmt.Sprintf("levels up to %d", schema.Highest()), "kvipamctl downgrade enable v0.2.0-test", "nothing was written"} {
		require.Contains(t, err.Error(), want)
	}
	after, err := cli.Get(ctx, etcdstore.Prefix, clientv3.WithPrefix())
	require.NoError(t, err)
	require.Equal(t, before.Header.Revision, after.Header.Revision, "the refused agent wrote nothing")
	require.Len(t, after.Kvs, 1, "only the schema key")
}

// TestFeatureWaitsForOldestAgent: the cluster's level, and with it
// pool-max-blocks, waits for the oldest live agent. With an agent of
// level 1 alive the level stays 1 and kvipamctl's pool set-max-blocks
// (UpdatePool) is refused naming it; once it is gone the remaining agent
// raises the level by itself, the same write is accepted, and the agent
// honours the limit: no second block, the pool exhausted for it.
func TestFeatureWaitsForOldestAgent(t *testing.T) {
	e := etcdtest.Start(t)
	cli := etcdtest.Client(t, e)
	st := etcdstore.New(cli, etcdstore.Options{})
	ctx := context.Background()
	cfg := testConfig(t, e)
	cfg.Pools = []allocator.Pool{{Name: "default", BlockSizeV4: 28, CIDRs: []netip.Prefix{netip.MustParsePrefix("10.78.0.0/24")}}}
	ta := startAgent(t, cfg, Options{Version: "v0.2.0-test"})
	awaitLevel(t, cli, st, schema.Highest())

	// An older agent joins: the level was raised before it came, and it
	// refuses; the operator holds the level at 1 for it.
	ocfg := testConfig(t, e)
	ocfg.Node, ocfg.Pools = "node-2", cfg.Pools
	err := olderAgent(t, ocfg).Run(ctx, nil)
	require.ErrorIs(t, err, etcdstore.ErrSchemaLevel, "level %d is above what it understands", schema.Highest())
	_, err = st.EnableDowngrade(ctx, schema.Base, "test")
	require.NoError(t, err)
	old := runAgent(t, olderAgent(t, ocfg))
	_, err = old.c.Allocate(ctx, api.AllocateRequest{Owner: owner(1000), Families: []string{"ipv4"}})
	require.NoError(t, err, "the older node holds a block")
	_, _, err = st.CancelDowngrade(ctx, "test")
	require.NoError(t, err)
	set, raised, err := st.RaiseSchema(ctx, schema.Highest(), "test", "test")
	require.NoError(t, err)
	require.False(t, raised, "a live node of level 1 keeps the level at 1")
	require.Equal(t, schema.Base, set.Level)
	_, err = st.UpdatePool(ctx, "default", func(p *allocator.Pool) error { p.MaxBlocksPerNode = 1; return nil })
	require.ErrorIs(t, err, etcdstore.ErrSchemaLevel)
	require.Contains(t, err.Error(), "node-2 (v0.1.9, level 1)", "the refusal names the node that holds it back")

	// The older agent goes; its node record with its lease. It holds a
	// block: it is away, not gone, and may come back as any release, so
	// the level waits for it (as etcd's cluster version counts a member
	// that is down), and the feature is refused naming it.
	rec, ok, err := st.ReadNode(ctx, "node-2")
	require.NoError(t, err)
	require.True(t, ok)
	old.shutdown()
	_, err = cli.Revoke(ctx, clientv3.LeaseID(rec.Lease))
	require.NoError(t, err)
	_, raised, err = st.RaiseSchema(ctx, schema.Highest(), "test", "test")
	require.ErrorIs(t, err, etcdstore.ErrNodesAway)
	require.False(t, raised)
	require.Contains(t, err.Error(), "waits for node-2")
	_, err = st.UpdatePool(ctx, "default", func(p *allocator.Pool) error { p.MaxBlocksPerNode = 1; return nil })
	require.ErrorIs(t, err, etcdstore.ErrSchemaLevel)
	require.Contains(t, err.Error(), "it waits for node-2, which hold blocks but have no live record")

	// It comes back upgraded: the agents raise the level by themselves.
	startAgent(t, ocfg, Options{Version: "v0.2.0-test"})
	awaitLevel(t, cli, st, schema.Highest())
	p, err := st.UpdatePool(ctx, "default", func(p *allocator.Pool) error { p.MaxBlocksPerNode = 1; return nil })
	require.NoError(t, err)
	require.Equal(t, 1, p.MaxBlocksPerNode)

	// The agent follows the pool (a watch; awaited here) and claims no
	// second block: one /28's addresses as the pool hands them out, then
	// exhausted.
	for {
		if sp, ok := ta.a.alloc.Pool("default"); ok && sp.Rev >= p.Rev {
			require.Equal(t, 1, sp.MaxBlocksPerNode)
			break
		}
		time.Sleep(10 * time.Millisecond) // polls the agent's view until the watch delivered
	}
	var got int
	for i := 0; ; i++ {
		_, err := ta.c.Allocate(ctx, api.AllocateRequest{Owner: owner(i), Families: []string{"ipv4"}})
		if err != nil {
			require.Equal(t, api.CodeExhausted, apiErr(t, err).Code, "the %dth address: %v", i, err)
			require.Contains(t, err.Error(), "This node holds the pool's max blocks per node (1) of ipv4")
			break
		}
		got++
		require.Less(t, got, 32, "more addresses than two blocks hold")
	}
	claims, err := cli.Get(ctx, etcdstore.AllClaimsPrefix(), clientv3.WithPrefix())
	require.NoError(t, err)
	mine := 0
	for _, kv := range claims.Kvs {
		if strings.Contains(string(kv.Value), `"node":"node-1"`) {
			mine++
		}
	}
	require.Equal(t, 1, mine, "node-1 claimed one block, at the pool's maxBlocksPerNode (it borrows from node-2's)")
	require.Positive(t, got)
}

// TestDowngradeBelowLevelRefused: at level 2 with a pool that uses
// pool-max-blocks, an agent that understands only level 1 is refused,
// and so is lowering the level (validate and enable name the pool);
// once the operator clears the pool's setting the level goes down and
// is held there (the agents do not raise it), the older agent starts,
// and the feature is refused while it runs; cancel lets the level go.
func TestDowngradeBelowLevelRefused(t *testing.T) {
	e := etcdtest.Start(t)
	cli := etcdtest.Client(t, e)
	st := etcdstore.New(cli, etcdstore.Options{})
	ctx := context.Background()
	cfg := testConfig(t, e)
	startAgent(t, cfg, Options{Version: "v0.2.0-test"})
	awaitLevel(t, cli, st, schema.Highest())
	_, err := st.UpdatePool(ctx, "default", func(p *allocator.Pool) error { p.MaxBlocksPerNode = 2; return nil })
	require.NoError(t, err)

	ocfg := testConfig(t, e)
	ocfg.Node = "node-2"
	err = olderAgent(t, ocfg).Run(ctx, nil)
	require.ErrorIs(t, err, etcdstore.ErrSchemaLevel)
	require.Contains(t, err.Error(), "v0.1.9")
	_, ok, err := st.ReadNode(ctx, "node-2")
	require.NoError(t, err)
	require.False(t, ok, "the refused agent wrote no node record")

	inUse, err := st.ValidateDowngrade(ctx, schema.Base)
	require.NoError(t, err)
	require.Equal(t, []etcdstore.LevelInUse{{What: "pool default", Uses: schema.PoolMaxBlocks, Needs: 2}}, inUse)
	_, err = st.EnableDowngrade(ctx, schema.Base, "test")
	require.ErrorIs(t, err, etcdstore.ErrSchemaLevel)
	require.Contains(t, err.Error(), "pool default uses pool-max-blocks (level 2)")
	set, err := st.ReadSchema(ctx)
	require.NoError(t, err)
	require.Equal(t, schema.Highest(), set.Level, "a refused downgrade leaves the level")

	_, err = st.UpdatePool(ctx, "default", func(p *allocator.Pool) error { p.MaxBlocksPerNode = 0; return nil })
	require.NoError(t, err)
	inUse, err = st.ValidateDowngrade(ctx, schema.Base)
	require.NoError(t, err)
	require.Empty(t, inUse)
	set, err = st.EnableDowngrade(ctx, schema.Base, "test")
	require.NoError(t, err)
	require.Equal(t, schema.Base, set.Level)
	require.True(t, set.Downgrade)

	runAgent(t, olderAgent(t, ocfg))
	// Held: the agent of level 2 does not raise it (RaiseSchema is what
	// its raiser calls on every node change; the older agent's start was
	// one), and the feature is refused.
	set, raised, err := st.RaiseSchema(ctx, schema.Highest(), "test", "test")
	require.NoError(t, err)
	require.False(t, raised)
	require.Equal(t, schema.Base, set.Level)
	_, err = st.UpdatePool(ctx, "default", func(p *allocator.Pool) error { p.MaxBlocksPerNode = 2; return nil })
	require.ErrorIs(t, err, etcdstore.ErrSchemaLevel)
	_, err = st.EnableDowngrade(ctx, schema.Highest(), "test")
	require.ErrorIs(t, err, etcdstore.ErrSchemaLevel, "a downgrade cannot raise the level")

	set, changed, err := st.CancelDowngrade(ctx, "test")
	require.NoError(t, err)
	require.True(t, changed)
	require.False(t, set.Downgrade)
	require.Equal(t, schema.Base, set.Level, "the older agent still runs: the level stays")
}
