package agent

import (
	"context"
	"encoding/json"
	"net/netip"
	"regexp"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/inspect"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/internal/testsupport/agenttest"
	"github.com/kvipam/kvipam/internal/testsupport/nstest"
	"github.com/kvipam/kvipam/internal/testsupport/syncbuf"
	"github.com/kvipam/kvipam/kvstore"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// TestLostEndpointsReported: node-1 is away while an operator removes it
// (with evidence) and node-2 takes its block and the IPv4 address of
// node-1's pod. When node-1 comes back, by a restart or when a partition
// heals, it does not take that address back; it reports the endpoint: a
// warning naming who holds the address now, the kvipam_endpoints_lost
// gauge, and its node record, which kvipamctl check reports. The IPv6
// block the operator freed is still free (nobody claimed it): node-1
// claims it again and writes back its pod's IPv6 address, so that the
// address is not handed out twice; the endpoint is kept for it.
func TestLostEndpointsReported(t *testing.T) {
	for _, tc := range []struct {
		name string
		// away runs node-1 with one endpoint, makes it leave etcd for
		// longer than its lease and calls taken (the operator and
		// node-2), then brings it back and returns it.
		away func(t *testing.T, e *kvstore.Embedded, cfg Config, logs *syncbuf.Buffer, taken func()) *testAgent
	}{
		{"restart", func(t *testing.T, e *kvstore.Embedded, cfg Config, logs *syncbuf.Buffer, taken func()) *testAgent {
			ta := startAgent(t, cfg, Options{})
			withEndpoint(t, ta)
			lease := ta.a.lease.session().ID()
			ta.shutdown()
			_, err := etcdtest.Client(t, e).Revoke(context.Background(), clientv3.LeaseID(lease))
			require.NoError(t, err)
			taken()
			return startAgent(t, cfg, Options{Logger: warnLog(logs)})
		}},
		{"partition heals", func(t *testing.T, e *kvstore.Embedded, cfg Config, logs *syncbuf.Buffer, taken func()) *testAgent {
			proxy := behindCutProxy(t, e, &cfg, 2*time.Second)
			ta := startAgent(t, cfg, Options{Logger: warnLog(logs)})
			withEndpoint(t, ta)
			lease := ta.a.lease.session()
			proxy.partition()
			<-lease.Done()
			cli := etcdtest.Client(t, e)
			require.Eventually(t, func() bool { // etcd expires the lease on its own clock
				resp, err := cli.Get(context.Background(), etcdstore.NodeKey(cfg.Node), clientv3.WithCountOnly())
				return err == nil && resp.Count == 0
			}, 10*time.Second, 50*time.Millisecond)
			taken()
			proxy.heal()
			require.NoError(t, waitReady(ta.c, 30*time.Second))
			return ta
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			e := etcdtest.Start(t)
			cli := etcdtest.Client(t, e)
			cfg := testConfig(t, e)
			host := nstest.NewNS(t)
			nstest.AddLink(t, nstest.Handle(t, host), "kvlost0")
			cfg.NetNS = host.Path()
			var logs syncbuf.Buffer
			var v4, v6 netip.Addr
			var n2Key string
			var n2Rev int64
			taken := func() {
				for _, al := range storeIPs(t, cli) {
					if al.Addr.Is4() {
						v4 = al.Addr
					} else {
						v6 = al.Addr
					}
				}
				in := inspect.New(cli, inspect.Options{})
				s, err := in.Snapshot(ctx)
				require.NoError(t, err)
				now := time.Now().UTC()
				p, err := inspect.PlanNodeRemove(s, cfg.Node, inspect.Evidence{ConfirmGone: cfg.Node, LastSeen: now, StatedBy: "tester", StatedAt: now}, false)
				require.NoError(t, err)
				_, err = in.Execute(ctx, p, nil)
				require.NoError(t, err)
				n2 := agenttest.Start(t, e, "node-2", agenttest.Options{Pools: []string{testPool.Name}})
				res, err := n2.Alloc.Allocate(ctx, nodealloc.Request{Pool: testPool.Name, Owner: agenttest.Owner(100), IPs: []netip.Addr{v4}})
				require.NoError(t, err)
				n2Key, n2Rev = etcdstore.IPKey(testPool.Name, res.Allocations[0].Block, v4), res.Allocations[0].Rev
			}
			ta := tc.away(t, e, cfg, &logs, taken)

			// The report: a warning, the gauge, the node record.
			require.Eventually(t, func() bool { return lostGauge(t, ta) == 1 }, 10*time.Second, 20*time.Millisecond)
			// Found by the check after the lease came back, or by the
			// comparison with etcd when it answered again: whichever ran
			// first reports it.
			require.Contains(t, logs.String(), "delete the pod")
			require.Regexp(t, regexp.QuoteMeta(v4.String())+`.*held by ctr-0100/eth0 on (node )?node-2`, logs.String())
			require.NotContains(t, logs.String(), v6.String()+" held by")
			require.Contains(t, logs.String(), "written back: owner=ctr-0001/eth0 pod=ns/pod-1 pool="+testPool.Name+" ip="+v6.String())
			require.Contains(t, logs.String(), "ctr-0001/eth0")
			var rec etcdstore.NodeRecord
			require.Eventually(t, func() bool {
				resp, err := cli.Get(ctx, etcdstore.NodeKey(cfg.Node))
				require.NoError(t, err)
				return len(resp.Kvs) == 1 && json.Unmarshal(resp.Kvs[0].Value, &rec) == nil && len(rec.LostEndpoints) == 1
			}, 10*time.Second, 20*time.Millisecond)
			le := rec.LostEndpoints[0]
			require.Equal(t, "ctr-0001/eth0", le.Owner)
			require.Equal(t, "pod-1", le.Pod)
			require.True(t, le.Kept, "kept for its IPv6 address")
			require.Equal(t, []etcdstore.LostIP{
				{IP: v4.String(), Pool: testPool.Name, HeldBy: "ctr-0100/eth0", HeldByNode: "node-2"},
			}, le.IPs)

			// kvipamctl check sees it.
			in := inspect.New(cli, inspect.Options{})
			s, err := in.Snapshot(ctx)
			require.NoError(t, err)
			r, err := in.Check(ctx, s)
			require.NoError(t, err)
			require.Len(t, r.Findings, 1, "%+v", r.Findings)
			require.Equal(t, inspect.KindLostEndpoint, r.Findings[0].Kind)
			require.Contains(t, r.Findings[0].Keys, n2Key)
			require.Contains(t, r.Findings[0].Message, "ns/pod-1")

			// node-1 took back nothing another node holds: node-2's key
			// is as node-2 wrote it; the endpoint stays for its IPv6
			// address, which node-1 holds again.
			eps, err := ta.c.Endpoints(ctx)
			require.NoError(t, err)
			require.Len(t, eps, 1)
			resp, err := cli.Get(ctx, n2Key)
			require.NoError(t, err)
			require.Len(t, resp.Kvs, 1)
			require.Equal(t, n2Rev, resp.Kvs[0].ModRevision, "node-2's allocation is never re-written")
			held, err := ta.c.Allocations(ctx, owner(1))
			require.NoError(t, err)
			require.Len(t, held, 1)
			require.Equal(t, v6, held[0].Address.Addr())
		})
	}
}

// withEndpoint gives owner 1 an address of each family and an endpoint on
// the host interface kvlost0.
func withEndpoint(t testing.TB, ta *testAgent) {
	t.Helper()
	ctx := context.Background()
	_, err := ta.c.Allocate(ctx, api.AllocateRequest{Owner: owner(1)})
	require.NoError(t, err)
	_, err = ta.c.CreateEndpoint(ctx, api.EndpointRequest{Owner: owner(1), HostIfName: "kvlost0"})
	require.NoError(t, err)
}

func warnLog(w *syncbuf.Buffer) hclog.Logger {
	return hclog.New(&hclog.LoggerOptions{Output: w, Level: hclog.Warn})
}

// lostGauge reads kvipam_endpoints_lost from the agent's registry.
func lostGauge(t testing.TB, ta *testAgent) float64 {
	t.Helper()
	mfs, err := ta.a.m.reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() == "kvipam_endpoints_lost" {
			return mf.GetMetric()[0].GetGauge().GetValue()
		}
	}
	t.Fatal("no kvipam_endpoints_lost")
	return 0
}
