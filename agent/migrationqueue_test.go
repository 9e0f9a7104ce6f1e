package agent

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/agent/delqueue"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/schema"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// TestQueuedDelOfMigrationTargetDropsAlternate: a live migration's target
// is admitted as the VM's alternate, and its ADD dies before its
// endpoint is made (the agent killed); its DEL, queued while the agent
// was away, names the pod's sticky identity as a DEL sent to the agent
// does, and drops the alternate when the agent drains it. The agent that
// comes back knows nothing of the target otherwise (no endpoint, and the
// records are the source's): the chaos run with migrations found the
// queued DEL applied with nothing released, the alternate left in etcd
// for good, and every later migration of the VM refused ("a third pod
// cannot join").
func TestQueuedDelOfMigrationTargetDropsAlternate(t *testing.T) {
	ctx := context.Background()
	e := etcdtest.Start(t)
	cfg := testConfig(t, e)
	a := startAgent(t, cfg, Options{})
	st := etcdstore.New(etcdtest.Client(t, e), etcdstore.Options{})
	_, _, err := st.RaiseSchema(ctx, schema.Highest(), "test", "test")
	require.NoError(t, err)
	src, dst := owner(1), owner(2)
	_, err = a.c.Allocate(ctx, api.AllocateRequest{Owner: src, Sticky: "1h", IPClaim: "vm1", Permanent: true})
	require.NoError(t, err)
	res, err := a.c.Allocate(ctx, api.AllocateRequest{Owner: dst, Sticky: "1h", IPClaim: "vm1", Migration: "job-1", Permanent: true})
	require.NoError(t, err)
	require.True(t, res.Alternate, "the target is admitted as the alternate")
	b, ok, err := st.GetBinding(ctx, "default", "ns/vm1")
	require.NoError(t, err)
	require.True(t, ok)
	require.NotNil(t, b.Alternate)

	// The agent dies before the target's endpoint is made; the runtime's
	// DEL finds it unreachable and queues it, as the plugin does.
	a.shutdown()
	require.NoError(t, delqueue.EnqueueRelease(cfg.delQueueDir(), api.ReleaseRequest{Owner: dst, Sticky: "1h", IPClaim: "vm1"}))
	startAgent(t, cfg, Options{})
	require.Eventually(t, func() bool {
		b, ok, err := st.GetBinding(ctx, "default", "ns/vm1")
		return err == nil && ok && b.Alternate == nil
	}, 10*time.Second, 50*time.Millisecond, "the queued DEL drops the target as the alternate")
	b, _, err = st.GetBinding(ctx, "default", "ns/vm1")
	require.NoError(t, err)
	require.Equal(t, src.ContainerID, b.Owner.ContainerID, "the source holds the identity on")
	queued, err := delqueue.List(cfg.delQueueDir())
	require.NoError(t, err)
	require.Empty(t, queued)
}
