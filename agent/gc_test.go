package agent

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// TestGCKeepsReusedAddress pauses GC between its decision (from a snapshot
// of the node's allocations) and its releases. Meanwhile the doomed owner
// is deleted and its address is handed to a new, valid owner. GC must
// release only what it decided on (same owner, same revision), never the
// new owner's allocation of the same address.
func TestGCKeepsReusedAddress(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name string
		// reserve: the doomed owner holds a reservation that lapses before
		// GC runs, and the new owner reserves the address too.
		reserve bool
	}{{"deleted-then-reused", false}, {"lapsed-reservation-reused", true}} {
		t.Run(tc.name, func(t *testing.T) {
			e := etcdtest.Start(t)
			cli := etcdtest.Client(t, e)
			cfg := testConfig(t, e)
			cfg.GCGrace = Duration{time.Minute}
			cfg.ReservationTTL = Duration{time.Second}
			ta := startAgent(t, cfg, Options{})
			doomed, fresh := owner(1), owner(2)
			r, err := ta.c.Allocate(ctx, api.AllocateRequest{Owner: doomed, Permanent: !tc.reserve, Families: []string{"ipv4"}})
			require.NoError(t, err)
			addr := r.IPs[0].Address.Addr()
			block := r.IPs[0].Block
			key := etcdstore.IPKey(testPool.Name, block, addr)
			if tc.reserve {
				waitDeleted(t, cli, key)
			}
			ta.a.gc.testHookDecided = func() {
				if !tc.reserve {
					_, err := ta.c.Release(ctx, doomed)
					require.NoError(t, err)
				}
				got, err := ta.c.Allocate(ctx, api.AllocateRequest{Owner: fresh, Permanent: !tc.reserve, IPs: api.Addrs{addr}})
				require.NoError(t, err, "the address is free for a new owner")
				require.Equal(t, r.IPs[0].Address, got.IPs[0].Address)
			}
			valid := []api.Attachment{{ContainerID: fresh.ContainerID, IfName: fresh.IfName}}
			res, err := ta.a.gc.collect(ctx, api.GCRequest{ValidAttachments: valid}, time.Now().Add(time.Hour))
			require.NoError(t, err)
			require.NotContains(t, res.Released, addr.String(), "GC released the new owner's address")

			resp, err := cli.Get(ctx, key)
			require.NoError(t, err)
			require.Len(t, resp.Kvs, 1, "the new owner's allocation is still in etcd")
			require.Contains(t, string(resp.Kvs[0].Value), fresh.ContainerID)
			held, err := ta.c.Allocations(ctx, fresh)
			require.NoError(t, err)
			require.Len(t, held, 1, "and the agent still knows it")
			if tc.reserve {
				_, err := ta.a.alloc.Confirm(ctx, fresh)
				require.NoError(t, err, "the new owner's ADD completes")
			}
			// A third owner cannot get the address while the second has it.
			_, err = ta.c.Allocate(ctx, api.AllocateRequest{Owner: owner(3), Permanent: true, IPs: api.Addrs{addr}})
			require.Equal(t, api.CodeInUse, apiErr(t, err).Code)
		})
	}
}

// waitDeleted waits for key to be deleted (a lease expiring), by watching it.
func waitDeleted(t testing.TB, cli *clientv3.Client, key string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	resp, err := cli.Get(ctx, key)
	require.NoError(t, err)
	if len(resp.Kvs) == 0 {
		return
	}
	for wr := range cli.Watch(ctx, key, clientv3.WithRev(resp.Header.Revision+1)) {
		for _, ev := range wr.Events {
			if ev.Type == clientv3.EventTypeDelete {
				return
			}
		}
	}
	t.Fatalf("%s was not deleted: %v", key, ctx.Err())
}

// plantForeignClaim makes testPool and, in it, a block whose home is
// node-1 and which holds a pod's address (ctr-0007's, returned), claimed
// by another node ("intruder"): node-1's agent cannot restore it until
// that claim is deleted.
func plantForeignClaim(t *testing.T, cli *clientv3.Client) (netip.Prefix, netip.Addr) {
	t.Helper()
	ctx := context.Background()
	_, err := etcdstore.New(cli, etcdstore.Options{}).EnsurePool(ctx, testPool)
	require.NoError(t, err)
	block := netip.MustParsePrefix("10.77.0.32/27")
	pod := netip.MustParseAddr("10.77.0.33")
	for k, v := range map[string]string{
		etcdstore.HomeKey(testPool.Name, block):    `{"node":"node-1"}`,
		etcdstore.ClaimKey(testPool.Name, block):   `{"node":"intruder"}`,
		etcdstore.IPKey(testPool.Name, block, pod): `{"containerID":"ctr-0007","ifName":"eth0","node":"node-1","state":"allocated"}`,
	} {
		_, err := cli.Put(ctx, k, v)
		require.NoError(t, err)
	}
	return block, pod
}

// TestRestoreFailureServesNotReady plants a claim by another node over a
// block whose home is this node and which holds a pod's address. The agent
// cannot re-claim it, so it must not serve allocations: status says
// ready=false and names the block; allocate and release answer try-again.
// Once the bad claim is gone, the agent restores by itself and knows the
// pod's address.
func TestRestoreFailureServesNotReady(t *testing.T) {
	ctx := context.Background()
	e := etcdtest.Start(t)
	cli := etcdtest.Client(t, e)
	block, pod := plantForeignClaim(t, cli)
	ta := startAgent(t, testConfig(t, e), Options{})
	st, err := ta.c.Status(ctx)
	require.NoError(t, err)
	require.False(t, st.Ready)
	require.Contains(t, st.Message, block.String())
	require.Contains(t, st.Message, "intruder")
	_, err = ta.c.Allocate(ctx, api.AllocateRequest{Owner: owner(1)})
	require.Equal(t, api.CodeTryAgain, apiErr(t, err).Code)
	_, err = ta.c.Release(ctx, owner(7))
	require.Equal(t, api.CodeTryAgain, apiErr(t, err).Code)

	_, err = cli.Delete(ctx, etcdstore.ClaimKey(testPool.Name, block))
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		st, err := ta.c.Status(ctx)
		return err == nil && st.Ready
	}, 30*time.Second, 50*time.Millisecond, "the agent restores once it can re-claim its block")
	held, err := ta.c.Allocations(ctx, owner(7))
	require.NoError(t, err)
	require.Len(t, held, 1)
	require.Equal(t, netip.PrefixFrom(pod, 32), held[0].Address)
}

// TestGCGraceIgnoresWallClock restores an allocation whose stored since is
// two hours old, as after a step of the wall clock (or a node whose clock
// ran ahead). GC counts the grace period from when this agent learned of
// it, on the monotonic clock, so it is not collected at once.
func TestGCGraceIgnoresWallClock(t *testing.T) {
	ctx := context.Background()
	e := etcdtest.Start(t)
	cli := etcdtest.Client(t, e)
	_, err := etcdstore.New(cli, etcdstore.Options{}).EnsurePool(ctx, testPool)
	require.NoError(t, err)
	block := netip.MustParsePrefix("10.77.0.32/27")
	since := time.Now().Add(-2 * time.Hour).UTC().Format(time.RFC3339Nano)
	for k, v := range map[string]string{
		etcdstore.HomeKey(testPool.Name, block):                                  `{"node":"node-1"}`,
		etcdstore.IPKey(testPool.Name, block, netip.MustParseAddr("10.77.0.33")): `{"containerID":"ctr-0007","ifName":"eth0","node":"node-1","state":"allocated","since":"` + since + `"}`,
	} {
		_, err := cli.Put(ctx, k, v)
		require.NoError(t, err)
	}
	cfg := testConfig(t, e)
	cfg.GCGrace = Duration{time.Minute}
	ta := startAgent(t, cfg, Options{})
	res, err := ta.c.GC(ctx, api.GCRequest{ValidAttachments: []api.Attachment{}})
	require.NoError(t, err)
	require.Empty(t, res.Released, "known to this agent for less than the grace period")
	require.Equal(t, 1, res.Deferred)
	later, err := ta.a.gc.collect(ctx, api.GCRequest{}, time.Now().Add(2*time.Minute))
	require.NoError(t, err)
	require.Equal(t, []string{"10.77.0.33"}, later.Released, "collected once the grace period has passed here")
}
