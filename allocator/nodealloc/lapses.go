package nodealloc

import (
	"sync"
	"time"

	"github.com/kvipam/kvipam/allocator/records"
)

// A reservation that lapses (an ADD that never finished) ends an
// ownership interval with no release to record it: its key goes with its
// lease. The node notices the lapse in its cache (dropIfLapsed) and keeps
// it here until RecordLapses has written it to IP history through the
// Store, which waits for etcd to agree that the key is gone.

// maxLapses bounds the reservations waiting to be recorded; beyond it the
// oldest are dropped (and logged: the allocator.ip log line of the lapse
// is the record then).
const maxLapses = 4096

// lapseGiveUp is how long a lapse is retried while the store still holds
// the reservation as it was; a lease outliving its TTL by that much is
// not a lapse the node will see end.
const lapseGiveUp = time.Hour

type lapse struct {
	al  records.Allocation
	end time.Time
}

type lapses struct {
	mu      sync.Mutex
	pending []lapse
	dropped int
}

func (l *lapses) add(al records.Allocation, end time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.pending) >= maxLapses {
		l.pending = l.pending[1:]
		l.dropped++
	}
	l.pending = append(l.pending, lapse{al: al, end: end})
}

func (l *lapses) take() []lapse {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := l.pending
	l.pending = nil
	return out
}

func (l *lapses) putBack(ls []lapse) {
	for _, x := range ls {
		l.add(x.al, x.end)
	}
}
