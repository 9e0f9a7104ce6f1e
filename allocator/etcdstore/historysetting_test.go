package etcdstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// TestHistorySetting: the agents' IP-history retention is stored once,
// rewritten only when it changes, read back as written (0: history off),
// and an unreadable record is an error that the next agent's write
// replaces.
func TestHistorySetting(t *testing.T) {
	ctx := context.Background()
	cli := etcdtest.Client(t, etcdtest.Start(t))
	st := etcdstore.New(cli, etcdstore.Options{})

	_, found, err := st.HistoryRetention(ctx)
	require.NoError(t, err)
	require.False(t, found, "no agent has stored one")

	written, err := st.PublishHistoryRetention(ctx, 12*time.Hour, "n1")
	require.NoError(t, err)
	require.True(t, written)
	at := writtenAt(t, ctx, st)
	written, err = st.PublishHistoryRetention(ctx, 12*time.Hour, "n2")
	require.NoError(t, err)
	require.False(t, written, "the same retention is not written again")
	h, found, err := st.HistoryRetention(ctx)
	require.NoError(t, err)
	require.True(t, found)
	require.Equal(t, 12*time.Hour, h.Retention)
	require.Equal(t, "n1", h.Node)
	require.False(t, h.At.IsZero())
	require.Equal(t, at, writtenAt(t, ctx, st), "nor touched")

	written, err = st.PublishHistoryRetention(ctx, 0, "n2")
	require.NoError(t, err)
	require.True(t, written, "a changed retention follows the agent")
	h, _, err = st.HistoryRetention(ctx)
	require.NoError(t, err)
	require.Equal(t, time.Duration(0), h.Retention, "history off")
	require.Equal(t, "n2", h.Node)

	_, err = st.PublishHistoryRetention(ctx, -time.Second, "n3")
	require.Error(t, err)

	resp, err := cli.Get(ctx, etcdstore.Prefix+"settings/history")
	require.NoError(t, err)
	require.Len(t, resp.Kvs, 1, "the key of docs/etcd-schema.md")
	require.JSONEq(t, `{"retention":"0s","node":"n2","at":"`+h.At.Format(time.RFC3339Nano)+`"}`, string(resp.Kvs[0].Value))

	_, err = cli.Put(ctx, etcdstore.Prefix+"settings/history", `{"retention":"a week"}`)
	require.NoError(t, err)
	_, _, err = st.HistoryRetention(ctx)
	require.ErrorContains(t, err, "a week")
	written, err = st.PublishHistoryRetention(ctx, time.Hour, "n3")
	require.NoError(t, err)
	require.True(t, written, "an unreadable record is replaced")
	h, _, err = st.HistoryRetention(ctx)
	require.NoError(t, err)
	require.Equal(t, time.Hour, h.Retention)
}

// writtenAt is when the history setting was last written.
func writtenAt(t *testing.T, ctx context.Context, st *etcdstore.Store) time.Time {
	t.Helper()
	h, _, err := st.HistoryRetention(ctx)
	require.NoError(t, err)
	return h.At
}
