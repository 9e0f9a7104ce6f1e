package agent

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// TestAgentStoresHistoryRetention: an agent stores its
// --history-retention in etcd at start, for kvipamctl; an agent started
// with another one (a changed configuration) replaces it.
func TestAgentStoresHistoryRetention(t *testing.T) {
	e := etcdtest.Start(t)
	st := etcdstore.New(etcdtest.Client(t, e), etcdstore.Options{})
	for _, retention := range []time.Duration{5 * time.Hour, 0} {
		cfg := testConfig(t, e)
		cfg.HistoryRetention = Duration{retention}
		ta := startAgent(t, cfg, Options{})
		h, found, err := st.HistoryRetention(context.Background())
		require.NoError(t, err)
		require.True(t, found)
		require.Equal(t, retention, h.Retention)
		require.Equal(t, "node-1", h.Node)
		ta.shutdown()
	}
}
