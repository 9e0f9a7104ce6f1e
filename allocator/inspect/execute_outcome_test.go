package inspect_test

import (
	"context"
	"errors"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/inspect"
)

// lostAnswers is an inspect.Client whose writing transactions commit in
// etcd and then report an error, n times, as a deadline passing after the
// commit. A transaction that only reads is answered.
// The inspector hands it to etcdstore.Operator.DeleteGuarded, which runs each
// step's transaction on it and reads the key back through it.
type lostAnswers struct {
	*clientv3.Client
	n int
}

func (l *lostAnswers) Txn(ctx context.Context) clientv3.Txn {
	return &lostTxn{Txn: l.Client.Txn(ctx), l: l}
}

type lostTxn struct {
	clientv3.Txn
	l      *lostAnswers
	writes bool
}

func (t *lostTxn) If(c ...clientv3.Cmp) clientv3.Txn { t.Txn = t.Txn.If(c...); return t }
func (t *lostTxn) Then(o ...clientv3.Op) clientv3.Txn {
	t.Txn, t.writes = t.Txn.Then(o...), t.writes || writes(o)
	return t
}
func (t *lostTxn) Else(o ...clientv3.Op) clientv3.Txn { t.Txn = t.Txn.Else(o...); return t }

func writes(ops []clientv3.Op) bool {
	return slices.ContainsFunc(ops, func(op clientv3.Op) bool { return op.IsPut() || op.IsDelete() })
}

func (t *lostTxn) Commit() (*clientv3.TxnResponse, error) {
	resp, err := t.Txn.Commit()
	if err != nil || t.l.n == 0 || !t.writes {
		return resp, err
	}
	t.l.n--
	return nil, errors.New("injected: context deadline exceeded (outcome unknown)")
}

// TestOperatorDeleteAnswerLostSettled: an operator's release commits and
// its answer is lost. Execute settles it by reading the key back, as
// every write of unknown outcome is settled: the step is reported
// deleted (its history record written with it), not failed.
func TestOperatorDeleteAnswerLostSettled(t *testing.T) {
	v := newEnv(t)
	n1 := startAgent(t, v.e, "n1", 0)
	al := allocate(t, n1, 0, 2, false)
	in := inspect.New(&lostAnswers{Client: v.cli, n: 1}, inspect.Options{History: etcdstore.NewHistoryRecorder(v.cli, etcdstore.DefaultHistoryRetention)})
	p, err := inspect.PlanReleaseIP(v.snapshot(t), "small", al[0].Addr, inspect.Evidence{}, true)
	require.NoError(t, err)
	res, err := in.Execute(t.Context(), p, nil)
	require.NoError(t, err, "the delete landed: settled from etcd")
	require.Equal(t, 1, res.Deleted)
	require.Equal(t, inspect.StatusDeleted, res.Outcomes[0].Status)
	require.False(t, v.exists(t, p.Steps[0].Key))
	hist, err := etcdstore.New(v.cli, etcdstore.Options{}).History(t.Context(), etcdstore.HistoryFilter{Pool: "small", IP: al[0].Addr})
	require.NoError(t, err)
	require.Len(t, hist, 1, "with its history record")
	require.Equal(t, etcdstore.EndOperatorRelease, hist[0].Reason)
}
