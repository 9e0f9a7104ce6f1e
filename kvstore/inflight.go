package kvstore

import (
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// inflight is one keepalive sent and not yet answered.
type inflight struct {
	gen  uint64 // the generation of the stream it was sent on
	s    *Session
	sent time.Time
}

// inflights are the unanswered keepalives in the order they were sent.
// etcd answers a stream's keepalives in order, so an answer belongs to
// the oldest unanswered keepalive of its lease on its stream; matching it
// to a later one would date etcd's renewal after it happened, and
// HeldUntil past the time etcd may expire the lease.
type inflights []inflight

func (q *inflights) add(f inflight) { *q = append(*q, f) }

// answer removes and returns the oldest keepalive of lease id sent on the
// stream of generation gen; false if there is none (it was dropped with
// its stream).
func (q *inflights) answer(gen uint64, id clientv3.LeaseID) (inflight, bool) {
	for i, f := range *q {
		if f.gen == gen && f.s.id == id {
			*q = append((*q)[:i], (*q)[i+1:]...)
			return f, true
		}
	}
	return inflight{}, false
}

// drop forgets the keepalives sent on the stream of generation gen and
// before: that stream is gone and their answers with it.
func (q *inflights) drop(gen uint64) {
	kept := (*q)[:0]
	for _, f := range *q {
		if f.gen > gen {
			kept = append(kept, f)
		}
	}
	clear((*q)[len(kept):])
	*q = kept
}

// has reports whether s has a keepalive unanswered on the stream of
// generation gen: a second would only queue behind it.
func (q inflights) has(gen uint64, s *Session) bool {
	for _, f := range q {
		if f.gen == gen && f.s == s {
			return true
		}
	}
	return false
}

// silent reports whether the stream has gone quiet: a keepalive is
// unanswered for longer than its session's interval, and nothing was
// heard on the stream (its opening, an answer) for as long. A stream
// that answers late but answers is kept: etcd under load answers in
// order, and each late answer still proves its lease from its send time.
func (q inflights) silent(now, heard time.Time) bool {
	for _, f := range q {
		if now.Sub(f.sent) > f.s.every && now.Sub(heard) > f.s.every {
			return true
		}
	}
	return false
}
