package agent

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/schema"
	"github.com/kvipam/kvipam/internal/testsupport/syncbuf"
	"github.com/kvipam/kvipam/kvstore"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// runRefused runs an agent that must refuse to start and returns its
// error; an agent that serves instead fails the test.
func runRefused(t testing.TB, cfg Config, o Options) error {
	t.Helper()
	a, err := New(cfg, o)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ready := make(chan struct{})
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx, ready) }()
	select {
	case err := <-done:
		return err
	case <-ready:
		cancel()
		<-done
		t.Fatalf("a second agent named %s started beside the first", cfg.Node)
		return nil
	}
}

// etcdState is every kvipam key with the revision it was written at and
// its lease: what an agent that writes nothing leaves as it found it.
func etcdState(t testing.TB, cli *clientv3.Client) map[string]string {
	t.Helper()
	resp, err := cli.Get(context.Background(), etcdstore.Prefix, clientv3.WithPrefix())
	require.NoError(t, err)
	out := map[string]string{}
	for _, kv := range resp.Kvs {
		out[string(kv.Key)] = fmt.Sprintf("rev %d lease %x", kv.ModRevision, kv.Lease)
	}
	return out
}

func nodeRecord(t testing.TB, cli *clientv3.Client, node string) (etcdstore.NodeRecord, bool) {
	t.Helper()
	resp, err := cli.Get(context.Background(), etcdstore.NodeKey(node))
	require.NoError(t, err)
	if len(resp.Kvs) == 0 {
		return etcdstore.NodeRecord{}, false
	}
	var rec etcdstore.NodeRecord
	require.NoError(t, json.Unmarshal(resp.Kvs[0].Value, &rec))
	return rec, true
}

// TestDuplicateNodeNameRefused: a second agent started under the name of
// a live node, from another machine (another boot ID) or with other node
// addresses (a clone, a container on the same host), refuses to start
// with an error that names both agents and says that node names must be
// unique, having written nothing: the first stays ready with its record,
// claims and allocations as they were. The same agent started again (the
// same boot ID and addresses: a restart within the lease TTL) starts.
func TestDuplicateNodeNameRefused(t *testing.T) {
	ctx := context.Background()
	e := etcdtest.Start(t)
	cli := etcdtest.Client(t, e)
	cfgA := testConfig(t, e)
	cfgA.NodeAddresses = []string{"192.0.2.1"}
	optsA := Options{BootID: "boot-a", Version: "v-a"}
	a := startAgent(t, cfgA, optsA)
	// The agent raises the schema level once it sees itself the only
	// live node: awaited, so that the state compared below is settled.
	awaitLevel(t, cli, etcdstore.New(cli, etcdstore.Options{}), schema.Highest())
	var held []api.IPConfig
	for i := range 3 {
		r, err := a.c.Allocate(ctx, api.AllocateRequest{Owner: owner(i), Permanent: true})
		require.NoError(t, err)
		held = append(held, r.IPs...)
	}
	before := etcdState(t, cli)
	leases := func() []clientv3.LeaseStatus {
		resp, err := cli.Leases(ctx)
		require.NoError(t, err)
		return resp.Leases
	}
	leasesBefore := leases()
	recA, ok := nodeRecord(t, cli, cfgA.Node)
	require.True(t, ok)

	for _, tc := range []struct {
		name   string
		bootID string
		addrs  []string
	}{
		{"another boot ID", "boot-b", []string{"192.0.2.1"}},
		{"other node addresses", "boot-a", []string{"192.0.2.2"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfgB := testConfig(t, e) // its own state and socket: another machine
			cfgB.NodeAddresses = tc.addrs
			err := runRefused(t, cfgB, Options{BootID: tc.bootID, Version: "v-b"})
			require.ErrorIs(t, err, etcdstore.ErrNodeTaken)
			msg := err.Error()
			t.Log(msg)
			for _, want := range []string{
				`"node-1"`, "boot-a", "192.0.2.1", "v-a", recA.StartedAt.Format(time.RFC3339), fmt.Sprintf("%x", recA.Lease),
				tc.bootID, tc.addrs[0], "must be unique", "--node",
			} {
				require.Contains(t, msg, want)
			}
			require.Equal(t, before, etcdState(t, cli), "the refused agent wrote nothing")
			require.ElementsMatch(t, leasesBefore, leases(), "and left no lease behind")
			require.NoFileExists(t, cfgB.Socket)
			st, err := a.c.Status(ctx)
			require.NoError(t, err)
			require.True(t, st.Ready, st.Message)
			require.Nil(t, st.NameTaken)
		})
	}

	// The same agent again, its record still on its old lease.
	a.shutdown()
	a = startAgent(t, cfgA, optsA)
	var after []api.IPConfig
	for i := range 3 {
		r, err := a.c.Allocate(ctx, api.AllocateRequest{Owner: owner(i), Permanent: true})
		require.NoError(t, err)
		after = append(after, r.IPs...)
	}
	require.Equal(t, held, after)
	rec, ok := nodeRecord(t, cli, cfgA.Node)
	require.True(t, ok)
	require.Equal(t, a.a.lease.session().ID(), rec.Lease, "the record is on the new lease")
}

// TestNodeRecordTakenStopsServing: an agent finds its node record held by
// another incarnation of its name, on a lease an agent keeps alive:
// another agent started under the name while this one was cut off from
// etcd past its lease, or an agent that writes its record without a fence
// (an older version) overwrote it. Once it has seen that lease renewed
// (TestEtcdRestoreRevivedRecordNotTaken has one nobody renews), it stops
// serving new ADDs: readiness false naming both agents, the
// kvipam_node_name_conflict gauge, one ERROR line, the status API, and
// ADDs refused with node_name_taken; DELs go on. It never re-claims the
// node's blocks, not even once the other agent is gone: it stays so until
// it is restarted, and then starts as after any absence.
func TestNodeRecordTakenStopsServing(t *testing.T) {
	for _, tc := range []struct {
		name string
		// take makes another incarnation hold a's name; it returns the
		// lease the other's record is on and how the other goes away.
		take func(t *testing.T, e *kvstore.Embedded, a *testAgent, proxy *cutProxy) (lease int64, gone func())
	}{
		{"another agent started during a partition", func(t *testing.T, e *kvstore.Embedded, a *testAgent, proxy *cutProxy) (int64, func()) {
			cli := etcdtest.Client(t, e)
			lease := a.a.lease.session()
			proxy.partition()
			<-lease.Done()
			require.Eventually(t, func() bool { // etcd expires the lease on its own clock
				_, ok := nodeRecord(t, cli, a.a.cfg.Node)
				return !ok
			}, 10*time.Second, 20*time.Millisecond)
			cfgB := testConfig(t, e)
			cfgB.NodeAddresses = []string{"192.0.2.2"}
			b := startAgent(t, cfgB, Options{BootID: "boot-b", Version: "v-b"})
			bLease := b.a.lease.session().ID()
			blocks, err := etcdstore.New(cli, etcdstore.Options{}).ListBlocks(context.Background(), testPool.Name)
			require.NoError(t, err)
			require.NotEmpty(t, blocks)
			for _, bi := range blocks {
				require.Equal(t, bLease, bi.ClaimLease, "the other agent took the name's blocks")
			}
			proxy.heal()
			return bLease, func() {
				b.shutdown()
				_, err := cli.Revoke(context.Background(), clientv3.LeaseID(bLease))
				require.NoError(t, err)
			}
		}},
		{"record overwritten without a fence", func(t *testing.T, e *kvstore.Embedded, a *testAgent, _ *cutProxy) (int64, func()) {
			// An agent of an older version, which writes its record
			// without the fence, on its lease, which it keeps alive.
			cli := etcdtest.Client(t, e)
			l, err := cli.Grant(context.Background(), 3)
			require.NoError(t, err)
			kctx, stop := context.WithCancel(context.Background())
			t.Cleanup(stop)
			alive, err := cli.KeepAlive(kctx, l.ID)
			require.NoError(t, err)
			go func() {
				for range alive {
				}
			}()
			rec := etcdstore.NodeRecord{Name: a.a.cfg.Node, BootID: "boot-b", Version: "v-b", Addresses: []string{"192.0.2.2"},
				StartedAt: time.Now().UTC(), Lease: int64(l.ID)}
			val, err := json.Marshal(rec)
			require.NoError(t, err)
			_, err = cli.Put(context.Background(), etcdstore.NodeKey(rec.Name), string(val), clientv3.WithLease(l.ID))
			require.NoError(t, err)
			return int64(l.ID), func() {
				stop()
				_, err := cli.Revoke(context.Background(), l.ID)
				require.NoError(t, err)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			e := etcdtest.Start(t)
			cli := etcdtest.Client(t, e)
			cfg := testConfig(t, e)
			cfg.NodeAddresses = []string{"192.0.2.1"}
			proxy := behindCutProxy(t, e, &cfg, 2*time.Second)
			var logs syncbuf.Buffer
			opts := Options{BootID: "boot-a", Version: "v-a", Logger: warnLog(&logs)}
			a := startAgent(t, cfg, opts)
			var held []api.IPConfig
			for i := range 3 {
				r, err := a.c.Allocate(ctx, api.AllocateRequest{Owner: owner(i), Permanent: true})
				require.NoError(t, err)
				held = append(held, r.IPs...)
			}

			other, gone := tc.take(t, e, a, proxy)

			// Readiness, the status API, the gauge, one ERROR line.
			var st *api.Status
			var err error
			require.Eventually(t, func() bool {
				st, err = a.c.Status(ctx)
				return err == nil && st.NameTaken != nil
			}, 30*time.Second, 20*time.Millisecond, "the agent learns that its name is taken")
			require.False(t, st.Ready)
			for _, want := range []string{"boot-b", "192.0.2.2", "boot-a", "192.0.2.1", "must be unique"} {
				require.Contains(t, st.Message, want)
			}
			require.Equal(t, api.Incarnation{BootID: "boot-b", Addresses: []string{"192.0.2.2"}, Version: "v-b",
				StartedAt: st.NameTaken.Holder.StartedAt, Lease: other}, st.NameTaken.Holder)
			require.Equal(t, "boot-a", st.NameTaken.Self.BootID)
			require.Equal(t, []string{"192.0.2.1"}, st.NameTaken.Self.Addresses)
			require.Equal(t, 1.0, gauge(t, a, "kvipam_node_name_conflict"))
			var lines []string
			for _, l := range strings.Split(logs.String(), "\n") {
				if strings.Contains(l, "[ERROR]") && strings.Contains(l, "boot-b") {
					lines = append(lines, l)
				}
			}
			require.Len(t, lines, 1, logs.String())
			t.Log(lines[0])
			t.Log(st.Message)
			require.Contains(t, lines[0], "boot-a")

			// No new ADD; a DEL goes on.
			_, err = a.c.Allocate(ctx, api.AllocateRequest{Owner: owner(50)})
			ae := apiErr(t, err)
			require.Equal(t, api.CodeNameTaken, ae.Code, ae.Message)
			require.Equal(t, 409, ae.Status)
			require.Contains(t, ae.Message, "boot-b")
			_, err = a.c.Release(ctx, owner(0))
			require.NoError(t, err)
			for _, al := range storeIPs(t, cli) {
				require.NotEqual(t, owner(0).ContainerID, al.ContainerID, "the DEL released owner 0")
			}

			// The other agent goes: this one takes nothing back.
			gone()
			require.Never(t, func() bool {
				blocks, err := etcdstore.New(cli, etcdstore.Options{}).ListBlocks(ctx, testPool.Name)
				require.NoError(t, err)
				for _, bi := range blocks {
					if bi.Claim != nil {
						return true
					}
				}
				_, ok := nodeRecord(t, cli, cfg.Node)
				return ok
			}, 3*cfg.LeaseTTL.Duration, 50*time.Millisecond, "no claim and no node record while the agent is stopped")
			st, err = a.c.Status(ctx)
			require.NoError(t, err)
			require.False(t, st.Ready)
			require.NotNil(t, st.NameTaken)

			// Restarted, it starts as after any absence, with its pods'
			// addresses.
			a.shutdown()
			a = startAgent(t, cfg, opts)
			for i := 1; i < 3; i++ {
				r, err := a.c.Allocate(ctx, api.AllocateRequest{Owner: owner(i), Permanent: true})
				require.NoError(t, err)
				require.Equal(t, held[2*i:2*i+2], r.IPs)
			}
			require.Equal(t, 0.0, gauge(t, a, "kvipam_node_name_conflict"))
		})
	}
}

// gauge reads a gauge without labels from the agent's registry.
func gauge(t testing.TB, ta *testAgent, name string) float64 {
	t.Helper()
	mfs, err := ta.a.m.reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() == name {
			return mf.GetMetric()[0].GetGauge().GetValue()
		}
	}
	t.Fatalf("no %s", name)
	return 0
}
