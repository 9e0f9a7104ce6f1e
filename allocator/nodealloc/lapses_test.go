package nodealloc_test

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/nodealloc"
)

// TestLapsedReservationInHistory: a reservation never confirmed lapses
// with its lease; when its node notices (the owner asks again), the ended
// interval goes to IP history with the reason reservation-lapsed, once
// etcd has deleted the key.
func TestLapsedReservationInHistory(t *testing.T) {
	ctx := context.Background()
	e := startEtcd(t, small)
	n := startNode(t, e, "n1", []string{"small"}, nodeOpts{resTTL: time.Second})
	first, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(1), Reserve: true})
	require.NoError(t, err)
	al := first.Allocations[0]
	waitDeleted(t, n.cli, etcdstore.IPKey("small", al.Block, al.Addr), al.Rev)

	require.NoError(t, n.alloc.RecordLapses(ctx))
	require.Empty(t, history(t, n.store, al.Addr), "nothing lapsed that the node noticed")

	// The owner comes back: the node sees its reservation lapsed and
	// starts a new interval.
	_, err = n.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(1), Reserve: true})
	require.NoError(t, err)
	require.NoError(t, n.alloc.RecordLapses(ctx))
	recs := history(t, n.store, al.Addr)
	require.Len(t, recs, 1)
	r := recs[0]
	require.Equal(t, etcdstore.EndLapsed, r.Reason)
	require.Equal(t, owner(1).ContainerID, r.ContainerID)
	require.Equal(t, "n1", r.Node)
	require.True(t, r.End.Equal(first.Expires.UTC()), "ends when the reservation lapsed: %s, want %s", r.End, first.Expires)

	require.NoError(t, n.alloc.RecordLapses(ctx))
	require.Len(t, history(t, n.store, al.Addr), 1, "recorded once")
}

// TestRecordLapsedWaitsForEtcd: the store records a lapse only when etcd
// agrees: not while the key is still the reservation (its lease may have
// been extended across a leader change), not when the owner confirmed it,
// and yes when another owner holds the address now.
func TestRecordLapsedWaitsForEtcd(t *testing.T) {
	ctx := context.Background()
	e := startEtcd(t, small)
	n := startNode(t, e, "n1", []string{"small"}, nodeOpts{resTTL: time.Second})
	res, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(1), Reserve: true})
	require.NoError(t, err)
	al := res.Allocations[0]
	done, err := n.store.RecordLapsed(ctx, al, time.Now())
	require.NoError(t, err)
	require.False(t, done, "the key is still the reservation")
	require.Empty(t, history(t, n.store, al.Addr))

	_, err = n.alloc.Confirm(ctx, owner(1))
	require.NoError(t, err)
	done, err = n.store.RecordLapsed(ctx, al, time.Now())
	require.NoError(t, err)
	require.True(t, done, "confirmed by its owner: settled")
	require.Empty(t, history(t, n.store, al.Addr), "nothing ended")

	// Another owner holds the address now: the reservation did lapse.
	_, err = n.alloc.Release(ctx, owner(1))
	require.NoError(t, err)
	before := len(history(t, n.store, al.Addr))
	_, err = n.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(2), IPs: []netip.Addr{al.Addr}})
	require.NoError(t, err)
	done, err = n.store.RecordLapsed(ctx, al, time.Now())
	require.NoError(t, err)
	require.True(t, done)
	recs := history(t, n.store, al.Addr)
	require.Len(t, recs, before+1)
	require.Equal(t, etcdstore.EndLapsed, recs[len(recs)-1].Reason)
}

func history(t *testing.T, s *etcdstore.Store, addr netip.Addr) []etcdstore.HistoryRecord {
	t.Helper()
	recs, err := s.History(context.Background(), etcdstore.HistoryFilter{Pool: "small", IP: addr})
	require.NoError(t, err)
	return recs
}

// waitDeleted waits, by watching from rev, for key's delete.
func waitDeleted(t *testing.T, cli *clientv3.Client, key string, rev int64) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	for resp := range cli.Watch(ctx, key, clientv3.WithRev(rev)) {
		for _, ev := range resp.Events {
			if ev.Type == clientv3.EventTypeDelete {
				return
			}
		}
	}
	t.Fatalf("%s was not deleted: %v", key, ctx.Err())
}
