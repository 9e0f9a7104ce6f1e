package kvstore

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// TestInflightsAnswerTheOldest: an answer is the oldest unanswered
// keepalive of its lease on its stream, never a later one (that would
// date etcd's renewal after it happened), and never one sent on a newer
// stream; a dropped stream's keepalives are answered by nothing.
func TestInflightsAnswerTheOldest(t *testing.T) {
	t0 := time.Unix(1000, 0)
	a := &Session{id: clientv3.LeaseID(1), every: time.Second}
	b := &Session{id: clientv3.LeaseID(2), every: 3 * time.Second}
	var q inflights
	q.add(inflight{gen: 1, s: a, sent: t0})
	q.add(inflight{gen: 1, s: b, sent: t0.Add(100 * time.Millisecond)})
	q.add(inflight{gen: 1, s: a, sent: t0.Add(200 * time.Millisecond)})

	f, ok := q.answer(1, a.id)
	require.True(t, ok)
	require.Equal(t, t0, f.sent, "the oldest of lease 1")
	require.False(t, q.late(t0.Add(1200*time.Millisecond)), "a's second keepalive is 1s old")
	require.True(t, q.late(t0.Add(1201*time.Millisecond)), "a's second keepalive is over its interval")

	q.add(inflight{gen: 2, s: a, sent: t0.Add(2 * time.Second)})
	q.drop(1)
	_, ok = q.answer(1, a.id)
	require.False(t, ok, "a dropped stream's answer matches nothing")
	_, ok = q.answer(1, b.id)
	require.False(t, ok)
	f, ok = q.answer(2, a.id)
	require.True(t, ok)
	require.Equal(t, t0.Add(2*time.Second), f.sent)
	require.Empty(t, q)
}
