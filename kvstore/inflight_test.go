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
// stream; a dropped stream's keepalives are answered by nothing. A stream
// is silent only when a keepalive is late and nothing was heard for as
// long: one that answers late is kept.
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
	require.True(t, q.has(1, a) && q.has(1, b), "a and b each have one unanswered")
	require.False(t, q.has(2, a), "not on the next stream")
	heard := t0.Add(500 * time.Millisecond)
	require.False(t, q.silent(t0.Add(1200*time.Millisecond), heard), "a's second keepalive is 1s old")
	require.False(t, q.silent(t0.Add(1400*time.Millisecond), heard), "a's second is late, but the stream answered 0.9s ago")
	require.True(t, q.silent(t0.Add(1501*time.Millisecond), heard), "a's second is late and the stream silent for its interval")

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
