package agent

import (
	"context"
	"fmt"
	"net/netip"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/kvstore"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// refusals is etcd's back-pressure ("too many requests": refused before
// it was proposed, nothing written) on the writes of a sticky DEL (a
// release, a keep, a drop of a stale binding), put between an agent's
// allocator and etcd (Agent.testStore). It is safe for concurrent use.
type refusals struct {
	left    atomic.Int32 // writes still to refuse; below zero: every one
	refused atomic.Int32
}

func (r *refusals) wrap(s records.Store) records.Store { return refusingStore{Store: s, r: r} }

// refuse makes the next n writes refused (n < 0: all until refuse(0)).
func (r *refusals) refuse(n int32) { r.left.Store(n) }

func (r *refusals) busy(op string) error {
	for {
		n := r.left.Load()
		if n == 0 {
			return nil
		}
		if n < 0 || r.left.CompareAndSwap(n, n-1) {
			r.refused.Add(1)
			return fmt.Errorf("%s: %w", op, kvstore.Unavailable(rpctypes.ErrTooManyRequests))
		}
	}
}

type refusingStore struct {
	records.Store
	r *refusals
}

func (s refusingStore) DeleteIP(ctx context.Context, al records.Allocation) error {
	if err := s.r.busy("DeleteIP"); err != nil {
		return err
	}
	return s.Store.DeleteIP(ctx, al)
}

func (s refusingStore) Keep(ctx context.Context, b records.Binding, als []records.Allocation) (time.Time, error) {
	if err := s.r.busy("Keep"); err != nil {
		return time.Time{}, err
	}
	return s.Store.Keep(ctx, b, als)
}

func (s refusingStore) DropStaleBinding(ctx context.Context, b records.Binding, refs []records.IPRef, cur map[netip.Addr]records.Allocation) error {
	if err := s.r.busy("DropStaleBinding"); err != nil {
		return err
	}
	return s.Store.DropStaleBinding(ctx, b, refs, cur)
}

// startRefusing starts an agent whose allocator's writes meet r.
func startRefusing(t *testing.T, cfg Config, r *refusals) *testAgent {
	t.Helper()
	a, err := New(cfg, Options{})
	require.NoError(t, err)
	a.testStore = r
	return runAgent(t, a)
}

// TestRefusedStickyDelAcrossRestartDropsBinding: a sticky pod's ADD
// reserved its addresses and bound its identity, and the reservation
// lapsed before the endpoint was created (the runtime stalled). Its DEL,
// which names the identity as both plugins' DELs do, is refused by etcd
// ("too many requests"); the agent restarts, and its restore's sweep of
// stale bindings is refused too, once (it tries again) or for as long as
// it tries. The runtime's retried DEL names no identity (a DEL the queue
// drained, a runtime that sends no annotations): the agent kept the one
// the failed DEL named, so the retry still drops the binding, which
// names a container that holds nothing. The model test found the DEL
// that answered success and left the binding (seed 1795803060803679554,
// -model.faults 3).
func TestRefusedStickyDelAcrossRestartDropsBinding(t *testing.T) {
	for _, tc := range []struct {
		name  string
		sweep int32 // refusals the restore's sweep meets
	}{{"sweep refused once", 1}, {"sweep refused throughout", -1}} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			e := etcdtest.Start(t)
			cli := etcdtest.Client(t, e)
			st := etcdstore.New(cli, etcdstore.Options{})
			cfg := testConfig(t, e)
			cfg.ReservationTTL = Duration{time.Second}
			busy := &refusals{}
			ta := startRefusing(t, cfg, busy)
			o := owner(1)
			const identity = "ns/pod-1"
			bound := func() bool {
				_, ok, err := st.GetBinding(ctx, testPool.Name, identity)
				require.NoError(t, err)
				return ok
			}

			res, err := ta.c.Allocate(ctx, api.AllocateRequest{Owner: o, Sticky: "1h"})
			require.NoError(t, err, "the ADD's reservation")
			require.Equal(t, string(records.StateReserved), res.State)
			for _, ip := range res.IPs {
				key := etcdstore.IPKey(testPool.Name, ip.Block, ip.Address.Addr())
				require.Eventually(t, func() bool {
					resp, err := cli.Get(ctx, key)
					return err == nil && len(resp.Kvs) == 0
				}, 30*time.Second, 20*time.Millisecond, "the reservation of %s lapses with its lease", ip.Address)
			}
			require.True(t, bound())

			busy.refuse(-1)
			_, err = ta.c.ReleaseAttachment(ctx, api.ReleaseRequest{Owner: o, Sticky: "1h"})
			require.Equal(t, api.CodeTryAgain, apiErr(t, err).Code, "the DEL etcd refused says try again: %v", err)
			require.NotZero(t, busy.refused.Load())
			require.True(t, bound(), "nothing written")

			ta.shutdown()
			busy.refused.Store(0)
			busy.refuse(tc.sweep)
			ta = startRefusing(t, cfg, busy) // the agent restarted; its restore's sweep is refused
			require.NotZero(t, busy.refused.Load(), "the sweep met etcd's refusal")
			if tc.sweep < 0 {
				require.True(t, bound(), "refused for as long as the sweep tries: left")
				busy.refuse(0)
			} else {
				require.False(t, bound(), "the sweep tried again and dropped the binding")
			}

			rel, err := ta.c.ReleaseAttachment(ctx, api.ReleaseRequest{Owner: api.Owner{ContainerID: o.ContainerID, IfName: o.IfName}})
			require.NoError(t, err, "the runtime's retried DEL")
			require.Empty(t, rel.Released)
			require.False(t, bound(), "no binding names the container, which holds nothing")
			als, err := ta.c.Allocations(ctx, o)
			require.NoError(t, err)
			require.Empty(t, als)
		})
	}
}

// TestFailedStickyDelKeepsIdentity: a running sticky pod's DEL tears its
// endpoint down, and its release is refused by etcd; the agent restarts.
// The runtime's retried DEL names no identity and finds no endpoint: the
// agent noted the identity before the endpoint record went, and names it
// to the allocator until the release has landed.
func TestFailedStickyDelKeepsIdentity(t *testing.T) {
	cfg, h := hostNSConfig(t)
	ctx := context.Background()
	busy := &refusals{}
	ta := startRefusing(t, cfg, busy)
	const name = "kvkeep0"
	o := stickyEndpoint(t, ta, h, name)

	busy.refuse(-1)
	_, err := ta.c.ReleaseAttachment(ctx, api.ReleaseRequest{Owner: api.Owner{ContainerID: o.ContainerID, IfName: o.IfName}, HostIfName: name})
	require.Equal(t, api.CodeTryAgain, apiErr(t, err).Code, "%v", err)
	eps, err := ta.c.Endpoints(ctx)
	require.NoError(t, err)
	require.Empty(t, eps, "the endpoint is torn down")

	ta.shutdown()
	busy.refuse(0)
	ta = startRefusing(t, cfg, busy) // restarted
	named := namedIdentities(ta)
	_, err = ta.c.ReleaseAttachment(ctx, api.ReleaseRequest{Owner: api.Owner{ContainerID: o.ContainerID, IfName: o.IfName}, HostIfName: name})
	require.NoError(t, err, "the runtime's retried DEL")
	require.Equal(t, []string{"ns/pod-1"}, *named, "the retry names the identity the failed DEL noted")
	_, err = ta.c.ReleaseAttachment(ctx, api.ReleaseRequest{Owner: api.Owner{ContainerID: o.ContainerID, IfName: o.IfName}})
	require.NoError(t, err)
	require.Equal(t, []string{"ns/pod-1", ""}, *named, "once it landed, the note is gone")
}
