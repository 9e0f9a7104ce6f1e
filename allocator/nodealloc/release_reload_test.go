package nodealloc_test

import (
	"context"
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/allocator/records/memstore"
	"github.com/kvipam/kvipam/internal/foundation/retry"
)

// memLease is a node's lease on the in-memory store.
type memLease struct {
	st *memstore.Store
	id int64
}

func (l memLease) ID() int64  { return l.id }
func (l memLease) Lost() bool { return !l.st.LeaseAlive(l.id) }

// TestReleaseFailedWhileBlockReloadedIsNotReleased: a DEL whose delete
// failed before it was sent, settled in a read back that also adopted a
// claim whose answer was lost (the block's records indexed anew), must
// answer the failure: etcd still holds the address. It answered success
// (the cache held the record as another *Allocation, which release took
// for "gone"), and the pod's address stayed in etcd with nobody to
// release it (TestModelSimulated, seed 20261202, step 213442).
func TestReleaseFailedWhileBlockReloadedIsNotReleased(t *testing.T) {
	ctx := context.Background()
	st, hook, al, pool := memNode(t)

	o := records.Owner{ContainerID: "c1", IfName: "eth0"}
	// The claim carrying the first address lands and its answer is
	// lost; the adoption of the claim cannot read the block yet.
	hook.After("Claim", commitThenFail(1))
	hook.Before("ListIPs", failTimes(1, errTimedOut("ListIPs")))
	_, err := al.Allocate(ctx, nodealloc.Request{Pool: pool.Name, Owner: o, Reserve: true})
	require.Error(t, err)
	held := st.PoolIPs(pool.Name)
	require.Len(t, held, 1, "the claim and its first address landed")

	// The DEL: its delete fails before it is sent; the read back that
	// settles it adopts the claim (the block's records read anew).
	hook.Before("ListIPs", failTimes(1, errTimedOut("ListIPs")))
	hook.Before("DeleteIP", failTimes(1, errInjected))
	_, err = al.Release(ctx, o)
	require.Equal(t, held, st.PoolIPs(pool.Name), "the delete was never sent")
	require.Error(t, err, "a DEL whose address etcd still holds answers its failure")

	// The runtime's retried DEL releases it.
	_, err = al.Release(ctx, o)
	require.NoError(t, err)
	require.Empty(t, st.PoolIPs(pool.Name))
}

// TestReservationReadBackNotLapsedEarly: a reservation read back at a
// restore whose lease etcd answers as ending within the second (its TTL
// in whole seconds: 0) is still in etcd for up to a second: the owner's
// retried ADD must get it, not a second address of the family while etcd
// holds both (TestModelSimulated, seed 20261202, step 83847).
func TestReservationReadBackNotLapsedEarly(t *testing.T) {
	ctx := context.Background()
	ttl := 4 * time.Second
	st := memstore.New(memstore.Options{ReservationTTL: ttl})
	pool := allocator.Pool{Name: "p", BlockSizeV4: 29, CIDRs: []netip.Prefix{netip.MustParsePrefix("10.92.0.0/28")}}
	_, err := st.EnsurePool(ctx, pool)
	require.NoError(t, err)
	lease := memLease{st: st, id: st.Grant(30 * time.Second)}
	start := func() *nodealloc.Allocator {
		al, err := nodealloc.New(nodealloc.Config{Node: "n1", Store: st, Now: st.Now})
		require.NoError(t, err)
		require.NoError(t, al.Restore(ctx, lease))
		return al
	}
	o := records.Owner{ContainerID: "c1", IfName: "eth0"}
	res, err := start().Allocate(ctx, nodealloc.Request{Pool: pool.Name, Owner: o, Reserve: true})
	require.NoError(t, err)
	first := res.Allocations[0].Addr

	// The agent restarts when the reservation's lease has under a
	// second left, and the runtime retries the ADD a moment later.
	st.Advance(res.Expires.Sub(st.Now()) - 500*time.Millisecond)
	st.KeepAlive(lease.id)
	al := start()
	st.Advance(10 * time.Millisecond)
	res, err = al.Allocate(ctx, nodealloc.Request{Pool: pool.Name, Owner: o, Reserve: true})
	require.NoError(t, err)
	var mine []netip.Addr
	for _, x := range st.PoolIPs(pool.Name) {
		if x.Owner.Key() == o.Key() {
			mine = append(mine, x.Addr)
		}
	}
	require.Equal(t, []netip.Addr{first}, mine, "etcd holds one address of the family for the owner")
	require.Equal(t, first, res.Allocations[0].Addr, "the retried ADD gets the reservation etcd still holds")
}

// TestReleaseConflictUnreadBlockReadBack: a DEL whose delete meets a
// conflict (the record changed: here etcd lost it, restored from an
// older snapshot) while the block cannot be read again must not leave
// the cache holding the address for its owner: the owner's next ADD was
// answered the address etcd held for nobody (TestModelSimulated, seed
// 31337, step 30870).
func TestReleaseConflictUnreadBlockReadBack(t *testing.T) {
	ctx := context.Background()
	st, hook, al, pool := memNode(t)
	o := records.Owner{ContainerID: "c1", IfName: "eth0"}
	res, err := al.Allocate(ctx, nodealloc.Request{Pool: pool.Name, Owner: o})
	require.NoError(t, err)
	lost := res.Allocations[0].Addr
	st.Lose(pool.Name, lost)

	hook.Before("DeleteIP", failTimes(1, fmt.Errorf("delete: %w", retry.ErrConflict)))
	hook.Before("ListIPs", failTimes(1, errTimedOut("ListIPs")))
	_, err = al.Release(ctx, o)
	require.ErrorIs(t, err, retry.ErrConflict)

	res, err = al.Allocate(ctx, nodealloc.Request{Pool: pool.Name, Owner: o})
	require.NoError(t, err)
	held := map[netip.Addr]bool{}
	for _, x := range st.PoolIPs(pool.Name) {
		if x.Owner.Key() == o.Key() {
			held[x.Addr] = true
		}
	}
	for _, x := range res.Allocations {
		require.True(t, held[x.Addr], "the ADD was answered %s, which etcd does not hold for the owner", x.Addr)
	}
}

// memNode is node n1's allocator, restored, on a hooked memstore holding
// one small pool.
func memNode(t *testing.T) (*memstore.Store, *hookStore, *nodealloc.Allocator, allocator.Pool) {
	t.Helper()
	ctx := context.Background()
	st := memstore.New(memstore.Options{ReservationTTL: time.Minute})
	pool := allocator.Pool{Name: "p", BlockSizeV4: 29, CIDRs: []netip.Prefix{netip.MustParsePrefix("10.92.0.0/28")}}
	_, err := st.EnsurePool(ctx, pool)
	require.NoError(t, err)
	hook := newHookStore(st)
	al, err := nodealloc.New(nodealloc.Config{Node: "n1", Store: hook, Now: st.Now})
	require.NoError(t, err)
	require.NoError(t, al.Restore(ctx, memLease{st: st, id: st.Grant(30 * time.Second)}))
	return st, hook, al, pool
}
