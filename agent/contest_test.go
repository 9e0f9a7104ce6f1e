package agent

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/internal/testsupport/syncbuf"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// TestEtcdRestoreRevivedRecordNotTaken: etcd restored from a snapshot
// taken before this node's last reboot brings the node's record of its
// earlier boot back, on that boot's lease, which etcd revives for one
// TTL, and drops this agent's lease (granted after the snapshot). Nobody
// keeps the revived lease alive. The agent running through the restore
// must not take its name for taken by its own earlier boot: while that
// record lives it serves no new ADDs, answering try-again and saying why,
// and writes nothing; once the revived lease has expired it takes its
// name back (a new lease, its record, a restore) and serves again, its
// pods' addresses unchanged.
func TestEtcdRestoreRevivedRecordNotTaken(t *testing.T) {
	ctx := context.Background()
	e := etcdtest.Start(t)
	cli := etcdtest.Client(t, e)
	cfg := testConfig(t, e)
	cfg.NodeAddresses = []string{"192.0.2.1"}
	cfg.LeaseTTL = Duration{2 * time.Second}
	var logs syncbuf.Buffer
	opts := Options{BootID: "boot-now", Version: "v-a", Logger: hclog.New(&hclog.LoggerOptions{Output: &logs, Level: hclog.Info})}
	a := startAgent(t, cfg, opts)
	var held []api.IPConfig
	for i := range 3 {
		r, err := a.c.Allocate(ctx, api.AllocateRequest{Owner: owner(i), Permanent: true})
		require.NoError(t, err)
		held = append(held, r.IPs...)
	}
	mine := a.a.lease.session().ID()

	// The restore, as the agent sees it: its record is the earlier boot's
	// (same addresses, another boot ID, an older start) on a lease that
	// lives one TTL and that nobody renews, and its own lease is gone.
	revived, err := cli.Grant(ctx, 5)
	require.NoError(t, err)
	before := etcdstore.NodeRecord{Name: cfg.Node, BootID: "boot-before", Version: "v-a", Addresses: []string{"192.0.2.1"},
		StartedAt: time.Now().Add(-time.Hour).UTC().Truncate(time.Second), Lease: int64(revived.ID)}
	val, err := json.Marshal(before)
	require.NoError(t, err)
	_, err = cli.Put(ctx, etcdstore.NodeKey(cfg.Node), string(val), clientv3.WithLease(revived.ID))
	require.NoError(t, err)
	_, err = cli.Revoke(ctx, clientv3.LeaseID(mine))
	require.NoError(t, err)

	// Contested: not ready, saying why, never taken.
	why := fmt.Sprintf("another incarnation's record is on lease %x; waiting to see whether an agent keeps it alive", revived.ID)
	var st *api.Status
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		require.True(t, time.Now().Before(deadline), "the agent never said its name is contested")
		st, err = a.c.Status(ctx)
		require.NoError(t, err)
		require.Nil(t, st.NameTaken, "the agent took its own earlier boot's record for another agent: %s", st.Message)
		if strings.Contains(st.Message, why) {
			break
		}
	}
	t.Log(st.Message)
	require.False(t, st.Ready)
	require.NotNil(t, st.NameContested)
	require.Equal(t, api.Incarnation{BootID: "boot-before", Addresses: []string{"192.0.2.1"}, Version: "v-a",
		StartedAt: before.StartedAt, Lease: int64(revived.ID)}, st.NameContested.Holder)
	require.Equal(t, 0.0, gauge(t, a, "kvipam_node_name_conflict"))
	_, err = a.c.Allocate(ctx, api.AllocateRequest{Owner: owner(50)})
	ae := apiErr(t, err)
	require.Equal(t, api.CodeTryAgain, ae.Code, ae.Message)
	require.Equal(t, 503, ae.Status)
	require.Contains(t, ae.Message, why)
	// It writes nothing meanwhile: while etcd holds the earlier boot's
	// record, no block is claimed (one read, one revision).
	resp, err := cli.Get(ctx, etcdstore.Prefix, clientv3.WithPrefix())
	require.NoError(t, err)
	for _, kv := range resp.Kvs {
		if string(kv.Key) == etcdstore.NodeKey(cfg.Node) {
			require.Equal(t, int64(revived.ID), kv.Lease, "the agent wrote its record while contested")
		}
	}
	for _, kv := range resp.Kvs {
		if k, err := etcdstore.ParseKey(string(kv.Key)); err == nil {
			require.NotEqual(t, etcdstore.KeyClaim, k.Kind, "the agent claimed %s while contested", kv.Key)
		}
	}

	// The revived lease expires: the agent takes its name back.
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		require.True(t, time.Now().Before(deadline), "the agent never took its name back: %s", st.Message)
		st, err = a.c.Status(ctx)
		require.NoError(t, err)
		require.Nil(t, st.NameTaken, "the agent took its own earlier boot's record for another agent: %s", st.Message)
		if st.Ready {
			break
		}
	}
	require.Nil(t, st.NameContested)
	rec, ok := nodeRecord(t, cli, cfg.Node)
	require.True(t, ok)
	require.Equal(t, "boot-now", rec.BootID)
	require.Equal(t, a.a.lease.session().ID(), rec.Lease, "its record on its new lease")
	for i := range 3 {
		r, err := a.c.Allocate(ctx, api.AllocateRequest{Owner: owner(i), Permanent: true})
		require.NoError(t, err)
		require.Equal(t, held[2*i:2*i+2], r.IPs, "owner %d keeps its addresses", i)
	}
	_, err = a.c.Allocate(ctx, api.AllocateRequest{Owner: owner(60), Permanent: true})
	require.NoError(t, err, "a new ADD is served")
	require.Equal(t, 0.0, gauge(t, a, "kvipam_node_name_conflict"))
	require.NotContains(t, logs.String(), "[ERROR]")
	require.Contains(t, logs.String(), "never renewed: nobody's; taking the node's name back")
}

// TestLeaseRenewedReading: two readings of a lease's remaining TTL (etcd's
// whole seconds, truncated) prove a renewal only when no lease left alone
// could read so: a higher TTL, or a lease outliving the first reading by
// more than a second; never a lease counting down, nor one etcd has let
// expire but not yet revoked.
func TestLeaseRenewedReading(t *testing.T) {
	at := time.Unix(1_000_000, 0)
	read := func(ttl int64, after time.Duration) leaseReading {
		return leaseReading{ttl: ttl, sent: at.Add(after), answered: at.Add(after)}
	}
	for _, tc := range []struct {
		name    string
		a, b    leaseReading
		renewed bool
	}{
		{"the same second again", read(5, 0), read(5, 900*time.Millisecond), false},
		{"counting down", read(5, 0), read(2, 3*time.Second), false},
		{"counting down, truncation's worst case", read(5, 0), read(5, 999*time.Millisecond), false},
		{"higher", read(4, 0), read(5, 100*time.Millisecond), true},
		{"2 s lease renewed every 0.7 s reads 1, then 1 past a second", read(1, 0), read(1, 1100*time.Millisecond), true},
		{"the same past a second and a half", read(5, 0), read(5, 1500*time.Millisecond), true},
		{"expired, not yet revoked", read(1, 0), read(0, 3*time.Second), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.renewed, renewed(tc.a, tc.b))
		})
	}
}
