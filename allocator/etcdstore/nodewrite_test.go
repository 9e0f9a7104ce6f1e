package etcdstore_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// nodeFaults is a KV whose transactions meet a fault: before runs ahead
// of the n-th commit (counted from 1: a race another writer wins), and
// fault, if it returns an error for n, replaces the answer, after the
// commit (lost) or instead of it (never sent).
type nodeFaults struct {
	clientv3.KV
	commits int
	gets    int
	before  func(n int)
	fault   func(n int) (err error, sent bool)
}

func (f *nodeFaults) Txn(ctx context.Context) clientv3.Txn {
	return &nodeFaultTxn{Txn: f.KV.Txn(ctx), f: f}
}

func (f *nodeFaults) Get(ctx context.Context, key string, opts ...clientv3.OpOption) (*clientv3.GetResponse, error) {
	f.gets++
	return f.KV.Get(ctx, key, opts...)
}

type nodeFaultTxn struct {
	clientv3.Txn
	f *nodeFaults
}

func (t *nodeFaultTxn) If(c ...clientv3.Cmp) clientv3.Txn  { t.Txn = t.Txn.If(c...); return t }
func (t *nodeFaultTxn) Then(o ...clientv3.Op) clientv3.Txn { t.Txn = t.Txn.Then(o...); return t }
func (t *nodeFaultTxn) Else(o ...clientv3.Op) clientv3.Txn { t.Txn = t.Txn.Else(o...); return t }
func (t *nodeFaultTxn) Commit() (*clientv3.TxnResponse, error) {
	t.f.commits++
	n := t.f.commits
	if t.f.before != nil {
		t.f.before(n)
	}
	if t.f.fault != nil {
		if err, sent := t.f.fault(n); err != nil {
			if sent {
				_, _ = t.Txn.Commit()
			}
			return nil, err
		}
	}
	return t.Txn.Commit()
}

// TestWriteNodeFenced: the node record's one write creates the record,
// replaces one of the same incarnation (the same boot ID and addresses,
// in any order), and never one of another incarnation, whatever fails:
// an answer lost (settled by reading the record back), a write never
// sent or refused by etcd (known not written, no read back), a race lost
// to another incarnation or to the same one, the lease gone.
func TestWriteNodeFenced(t *testing.T) {
	ctx := context.Background()
	cli := etcdtest.Client(t, etcdtest.Start(t))
	grant := func() int64 {
		t.Helper()
		l, err := cli.Grant(ctx, 60)
		require.NoError(t, err)
		return int64(l.ID)
	}
	mine := func(name string) etcdstore.NodeRecord {
		return etcdstore.NodeRecord{Name: name, BootID: "boot-a", Version: "v1", Addresses: []string{"192.0.2.1", "2001:db8::1"},
			StartedAt: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)}
	}
	other := func(name string) etcdstore.NodeRecord {
		r := mine(name)
		r.BootID, r.Version = "boot-b", "v2"
		return r
	}
	// held reads the record etcd holds, its lease and revision.
	held := func(name string) (etcdstore.NodeRecord, int64, int64, bool) {
		t.Helper()
		resp, err := cli.Get(ctx, etcdstore.NodeKey(name))
		require.NoError(t, err)
		if len(resp.Kvs) == 0 {
			return etcdstore.NodeRecord{}, 0, 0, false
		}
		var r etcdstore.NodeRecord
		require.NoError(t, json.Unmarshal(resp.Kvs[0].Value, &r))
		return r, resp.Kvs[0].Lease, resp.Kvs[0].ModRevision, true
	}
	// blindPut writes r as an agent without the fence does.
	blindPut := func(r etcdstore.NodeRecord, lease int64) {
		t.Helper()
		val, err := json.Marshal(r)
		require.NoError(t, err)
		_, err = cli.Put(ctx, etcdstore.NodeKey(r.Name), string(val), clientv3.WithLease(clientv3.LeaseID(lease)))
		require.NoError(t, err)
	}
	faulted := func(f *nodeFaults) *etcdstore.Store {
		fc := clientv3.NewCtxClient(ctx)
		f.KV = cli.KV
		fc.KV, fc.Lease = f, cli.Lease
		return etcdstore.New(fc, etcdstore.Options{})
	}
	st := etcdstore.New(cli, etcdstore.Options{})

	t.Run("created, then replaced by its incarnation only", func(t *testing.T) {
		l1, l2 := grant(), grant()
		r := mine("n1")
		require.NoError(t, st.WriteNode(ctx, r, l1))
		got, lease, rev, ok := held("n1")
		require.True(t, ok)
		require.Equal(t, r, got)
		require.Equal(t, l1, lease)

		again := r
		again.Addresses = []string{"2001:db8::1", "192.0.2.1"} // the same, in another order
		require.NoError(t, st.WriteNode(ctx, again, l2), "the same incarnation, restarted on a new lease")
		_, lease, rev, _ = held("n1")
		require.Equal(t, l2, lease)

		for _, o := range []etcdstore.NodeRecord{other("n1"), func() etcdstore.NodeRecord {
			o := mine("n1")
			o.Addresses = []string{"192.0.2.2", "2001:db8::1"}
			return o
		}()} {
			err := st.WriteNode(ctx, o, grant())
			require.ErrorIs(t, err, etcdstore.ErrNodeTaken)
			var te *etcdstore.NodeTakenError
			require.ErrorAs(t, err, &te)
			require.Equal(t, "boot-a", te.Holder.BootID)
			require.Equal(t, l2, te.Holder.Lease, "the lease the holder's key is on")
			require.Equal(t, rev, te.Holder.Revision, "and its revision")
			require.Equal(t, o, te.Mine)
			require.Contains(t, err.Error(), "must be unique")
			_, lease, after, _ := held("n1")
			require.Equal(t, rev, after, "the holder's record is untouched")
			require.Equal(t, l2, lease)
		}
	})

	t.Run("answer lost, written: read back", func(t *testing.T) {
		f := &nodeFaults{fault: func(int) (error, bool) { return context.DeadlineExceeded, true }}
		l := grant()
		require.NoError(t, faulted(f).WriteNode(ctx, mine("n2"), l))
		got, lease, _, ok := held("n2")
		require.True(t, ok)
		require.Equal(t, mine("n2"), got)
		require.Equal(t, l, lease)
		require.Equal(t, 1, f.gets, "settled by one read")
	})

	t.Run("answer lost, not written: read back", func(t *testing.T) {
		f := &nodeFaults{fault: func(int) (error, bool) { return context.DeadlineExceeded, false }}
		err := faulted(f).WriteNode(ctx, mine("n3"), grant())
		require.ErrorIs(t, err, retry.ErrUnavailable)
		require.Contains(t, err.Error(), "read back: not written")
		_, _, _, ok := held("n3")
		require.False(t, ok)
	})

	t.Run("answer lost while another incarnation took the name", func(t *testing.T) {
		ol := grant()
		f := &nodeFaults{
			before: func(int) { blindPut(other("n4"), ol) },
			fault:  func(int) (error, bool) { return context.DeadlineExceeded, true },
		}
		err := faulted(f).WriteNode(ctx, mine("n4"), grant())
		var te *etcdstore.NodeTakenError
		require.ErrorAs(t, err, &te)
		require.Equal(t, "boot-b", te.Holder.BootID)
		got, lease, _, _ := held("n4")
		require.Equal(t, other("n4"), got)
		require.Equal(t, ol, lease)
	})

	t.Run("refused by etcd: known not written", func(t *testing.T) {
		f := &nodeFaults{fault: func(int) (error, bool) { return rpctypes.ErrTooManyRequests, false }}
		err := faulted(f).WriteNode(ctx, mine("n5"), grant())
		require.ErrorIs(t, err, retry.ErrRefused)
		require.Zero(t, f.gets, "nothing to read back")
		_, _, _, ok := held("n5")
		require.False(t, ok)
	})

	t.Run("race lost to another incarnation", func(t *testing.T) {
		require.NoError(t, st.WriteNode(ctx, mine("n6"), grant()))
		ol := grant()
		f := &nodeFaults{before: func(n int) {
			if n == 2 { // between the read of the record and its replace
				blindPut(other("n6"), ol)
			}
		}}
		err := faulted(f).WriteNode(ctx, mine("n6"), grant())
		require.ErrorIs(t, err, etcdstore.ErrNodeTaken)
		got, lease, _, _ := held("n6")
		require.Equal(t, other("n6"), got)
		require.Equal(t, ol, lease)
	})

	t.Run("race lost to its own incarnation", func(t *testing.T) {
		require.NoError(t, st.WriteNode(ctx, mine("n7"), grant()))
		f := &nodeFaults{before: func(n int) {
			if n == 2 {
				require.NoError(t, st.WriteNode(ctx, mine("n7"), grant())) // the agent's other write
			}
		}}
		l := grant()
		require.NoError(t, faulted(f).WriteNode(ctx, mine("n7"), l))
		require.Equal(t, 3, f.commits, "read, lost the race, read again, written")
		_, lease, _, _ := held("n7")
		require.Equal(t, l, lease)
	})

	t.Run("a record on no lease, written by hand", func(t *testing.T) {
		blindPut(other("n9"), 0)
		err := st.WriteNode(ctx, mine("n9"), grant())
		require.ErrorIs(t, err, etcdstore.ErrNodeTaken)
		require.Contains(t, err.Error(), "on no lease, so it never expires: if no agent runs under the name, delete "+etcdstore.NodeKey("n9"))
	})

	t.Run("lease gone", func(t *testing.T) {
		l := grant()
		_, err := cli.Revoke(ctx, clientv3.LeaseID(l))
		require.NoError(t, err)
		err = st.WriteNode(ctx, mine("n8"), l)
		require.ErrorIs(t, err, records.ErrLeaseLost)
		_, _, _, ok := held("n8")
		require.False(t, ok)

		live := grant()
		require.NoError(t, st.WriteNode(ctx, mine("n8"), live))
		_, _, rev, _ := held("n8")
		require.ErrorIs(t, st.WriteNode(ctx, mine("n8"), l), records.ErrLeaseLost, "replacing its own record on a lease gone")
		_, lease, after, _ := held("n8")
		require.Equal(t, rev, after)
		require.Equal(t, live, lease)
	})
}

// TestReadNodeAndLease: a node record as etcd holds it (the lease its key
// is on, its revision), and its lease's remaining TTL, truncated to whole
// seconds, until etcd no longer has it.
func TestReadNodeAndLease(t *testing.T) {
	ctx := context.Background()
	cli := etcdtest.Client(t, etcdtest.Start(t))
	st := etcdstore.New(cli, etcdstore.Options{})
	_, ok, err := st.ReadNode(ctx, "n1")
	require.NoError(t, err)
	require.False(t, ok)

	l, err := cli.Grant(ctx, 30)
	require.NoError(t, err)
	r := etcdstore.NodeRecord{Name: "n1", BootID: "boot-a", Addresses: []string{"192.0.2.1"}, Lease: int64(l.ID)}
	require.NoError(t, st.WriteNode(ctx, r, int64(l.ID)))
	resp, err := cli.Get(ctx, etcdstore.NodeKey("n1"))
	require.NoError(t, err)
	got, ok, err := st.ReadNode(ctx, "n1")
	require.NoError(t, err)
	require.True(t, ok)
	r.Revision = resp.Kvs[0].ModRevision
	require.Equal(t, r, got)

	ttl, err := st.ReadLeaseTTL(ctx, int64(l.ID))
	require.NoError(t, err)
	require.True(t, ttl.Found)
	require.Equal(t, int64(30), ttl.Granted)
	require.True(t, ttl.Remaining > 0 && ttl.Remaining < 30, "remaining %d of 30: truncated, below the TTL granted", ttl.Remaining)
	require.NotZero(t, ttl.Term)

	_, err = cli.Revoke(ctx, l.ID)
	require.NoError(t, err)
	ttl, err = st.ReadLeaseTTL(ctx, int64(l.ID))
	require.NoError(t, err)
	require.False(t, ttl.Found)
	_, ok, err = st.ReadNode(ctx, "n1")
	require.NoError(t, err)
	require.False(t, ok, "the record went with its lease")
}
