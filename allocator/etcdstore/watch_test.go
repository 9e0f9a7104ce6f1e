package etcdstore_test

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/allocator/schema"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// Typed watch events as a recorder sees them.
type (
	resetHomes []etcdstore.BlockHome
	putHome    etcdstore.BlockHome
	deleteHome struct {
		Pool  string
		Block netip.Prefix
	}
	resetNodes []etcdstore.NodeInfo
	putNode    etcdstore.NodeInfo
	deleteNode string
)

// recorder passes every watch call on as one of the event types above;
// homes and nodes are its Handlers of each kind of record.
type recorder chan any

type homes struct{ r recorder }

func (h homes) Reset(x []etcdstore.BlockHome) { h.r <- resetHomes(x) }
func (h homes) Put(x etcdstore.BlockHome)     { h.r <- putHome(x) }
func (h homes) Delete(x etcdstore.BlockHome)  { h.r <- deleteHome{x.Pool, x.Block} }

type nodes struct{ r recorder }

func (n nodes) Reset(x []etcdstore.NodeInfo) { n.r <- resetNodes(x) }
func (n nodes) Put(x etcdstore.NodeInfo)     { n.r <- putNode(x) }
func (n nodes) Delete(x etcdstore.NodeInfo)  { n.r <- deleteNode(x.Name) }

func (r recorder) next(tb testing.TB) any {
	tb.Helper()
	select {
	case ev := <-r:
		return ev
	case <-time.After(10 * time.Second):
		tb.Fatal("no watch event within 10s")
		return nil
	}
}

// follow runs watch until the test ends and checks that it returns ctx's
// error then.
func follow(tb testing.TB, watch func(context.Context, recorder) error) recorder {
	tb.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	r := make(recorder, 16)
	done := make(chan error, 1)
	go func() { done <- watch(ctx, r) }()
	tb.Cleanup(func() {
		cancel()
		require.ErrorIs(tb, <-done, context.Canceled)
	})
	return r
}

func TestWatchHomes(t *testing.T) {
	ctx := context.Background()
	cli := etcdtest.Client(t, etcdtest.Start(t))
	st := etcdstore.New(cli, etcdstore.Options{})
	lease, err := cli.Grant(ctx, 60)
	require.NoError(t, err)
	claim := func(pool, block, node string) (netip.Prefix, int64) {
		t.Helper()
		b := netip.MustParsePrefix(block)
		res, err := st.Claim(ctx, pool, b, records.Claim{Node: node, ClaimedAt: time.Now().UTC()}, int64(lease.ID))
		require.NoError(t, err)
		return b, res.Rev
	}
	a, arev := claim("p", "10.0.0.0/28", "node-a")
	b6, brev := claim("q", "fd00::/120", "node-b")

	r := follow(t, func(ctx context.Context, r recorder) error { return st.WatchHomes(ctx, homes{r}) })
	require.ElementsMatch(t, resetHomes{{Pool: "p", Block: a, Node: "node-a", Rev: arev}, {Pool: "q", Block: b6, Node: "node-b", Rev: brev}}, r.next(t),
		"the first call lists the homes of every pool")

	// A home that cannot be read is skipped, not delivered half decoded.
	_, err = cli.Put(ctx, etcdstore.HomeKey("p", netip.MustParsePrefix("10.0.0.32/28")), "not json")
	require.NoError(t, err)
	c, crev := claim("p", "10.0.0.16/28", "node-c")
	require.Equal(t, putHome{Pool: "p", Block: c, Node: "node-c", Rev: crev}, r.next(t), "each home with the revision it was written at")

	require.NoError(t, st.Unclaim(ctx, "p", c, crev))
	require.Equal(t, deleteHome{Pool: "p", Block: c}, r.next(t))
}

func TestWatchNodes(t *testing.T) {
	ctx := context.Background()
	cli := etcdtest.Client(t, etcdtest.Start(t))
	st := etcdstore.New(cli, etcdstore.Options{})
	put := func(name string, features []string, addrs ...string) clientv3.LeaseID {
		t.Helper()
		lease, err := cli.Grant(ctx, 60)
		require.NoError(t, err)
		require.NoError(t, st.WriteNode(ctx, etcdstore.NodeRecord{Name: name, Addresses: addrs, Lease: int64(lease.ID), Features: features}, int64(lease.ID)))
		return lease.ID
	}
	put("node-a", nil, "192.0.2.1", "2001:db8::1")

	r := follow(t, func(ctx context.Context, r recorder) error { return st.WatchNodes(ctx, nodes{r}) })
	require.Equal(t, resetNodes{{Name: "node-a", Addresses: []netip.Addr{netip.MustParseAddr("192.0.2.1"), netip.MustParseAddr("2001:db8::1")}, Level: schema.Base}}, r.next(t))

	// An address that does not parse is dropped; the rest of the record
	// is kept. The features it names give its schema level.
	lease := put("node-b", schema.Names(), "192.0.2.2", "not-an-address")
	require.Equal(t, putNode{Name: "node-b", Addresses: []netip.Addr{netip.MustParseAddr("192.0.2.2")}, Level: schema.Highest()}, r.next(t))

	// The record sits on the node's lease: when the lease ends, it goes.
	_, err := cli.Revoke(ctx, lease)
	require.NoError(t, err)
	require.Equal(t, deleteNode("node-b"), r.next(t))
}

// nodeRecords is a Handler of whole node records (WatchNode).
type nodeRecords struct{ r recorder }

type (
	resetRecords []etcdstore.NodeRecord
	putRecord    etcdstore.NodeRecord
)

func (n nodeRecords) Reset(x []etcdstore.NodeRecord) { n.r <- resetRecords(x) }
func (n nodeRecords) Put(x etcdstore.NodeRecord)     { n.r <- putRecord(x) }
func (n nodeRecords) Delete(x etcdstore.NodeRecord)  { n.r <- deleteNode(x.Name) }

// TestWatchNode: one node's record, whole, with the lease its key is on
// and its revision; the records of nodes whose names start with its name
// are not its own.
func TestWatchNode(t *testing.T) {
	ctx := context.Background()
	cli := etcdtest.Client(t, etcdtest.Start(t))
	st := etcdstore.New(cli, etcdstore.Options{})
	put := func(name, boot string) etcdstore.NodeRecord {
		t.Helper()
		lease, err := cli.Grant(ctx, 60)
		require.NoError(t, err)
		r := etcdstore.NodeRecord{Name: name, BootID: boot, Addresses: []string{"192.0.2.1"}, Lease: int64(lease.ID)}
		require.NoError(t, st.WriteNode(ctx, r, int64(lease.ID)))
		resp, err := cli.Get(ctx, etcdstore.NodeKey(name))
		require.NoError(t, err)
		r.Revision = resp.Kvs[0].ModRevision
		return r
	}
	n1 := put("node-1", "a")
	put("node-10", "b")

	r := follow(t, func(ctx context.Context, r recorder) error { return st.WatchNode(ctx, "node-1", nodeRecords{r}) })
	require.Equal(t, resetRecords{n1}, r.next(t))
	put("node-11", "c")
	_, err := cli.Revoke(ctx, clientv3.LeaseID(n1.Lease))
	require.NoError(t, err)
	require.Equal(t, deleteNode("node-1"), r.next(t), "node-11's record is not node-1's")
	again := put("node-1", "a")
	require.Equal(t, putRecord(again), r.next(t))
}
