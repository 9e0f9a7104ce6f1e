package memstore

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"sort"
	"time"

	"github.com/kvipam/kvipam/allocator/records"
)

// IP history, as etcdstore's HistoryRecorder keeps it: a record of each
// ended ownership interval, written with the step that ends it, kept for
// the retention past the end of its hour (etcdstore's lease of a bucket).

// Reasons an interval ends (etcdstore's End* constants).
const (
	endReleased       = "released"
	endLapsed         = "reservation-lapsed"
	endKept           = "kept-for-identity"
	endTakenOver      = "taken-over-by-identity"
	endMigrated       = "migrated"
	endAlternateEnded = "alternate-ended"
)

// histRec is one ended interval.
type histRec struct {
	key     string // etcdstore's order: end time, then owner
	pool    string
	addr    netip.Addr
	owner   records.Owner
	node    string
	start   time.Time
	end     time.Time
	reason  string
	expires time.Time
}

// historyOf is the record of al's interval ending at end.
func (s *Store) historyOf(al records.Allocation, end time.Time, reason string) histRec {
	end = end.UTC()
	bucket := min(time.Hour, s.opts.HistoryRetention)
	return histRec{
		key:  fmt.Sprintf("%020d-%s-%s", end.UnixNano(), al.ContainerID, al.IfName),
		pool: al.Pool, addr: al.Addr, owner: al.Owner, node: al.Node, start: al.Since.UTC(), end: end, reason: reason,
		expires: end.Truncate(bucket).Add(bucket + s.opts.HistoryRetention),
	}
}

// record adds rs to history in tx (nothing when history is off). A
// record of the same key replaces the earlier one, as a put would.
func (s *Store) record(tx *batch, rs ...histRec) {
	if s.opts.HistoryRetention < 0 {
		return
	}
	for _, r := range rs {
		tx.changed = true
		s.schedule(r.expires)
		k := addrKey{r.pool, r.addr}
		hs := s.history[k]
		i := sort.Search(len(hs), func(i int) bool { return hs[i].key >= r.key })
		if i < len(hs) && hs[i].key == r.key {
			hs[i] = r
			continue
		}
		s.history[k] = append(hs[:i], append([]histRec{r}, hs[i:]...)...)
	}
}

// expireHistory drops the records whose retention ended, one revision
// per retention lease (bucket) that ended. An address's records are in
// end order, so they expire from the front.
func (s *Store) expireHistory() {
	ended := map[time.Time]bool{}
	for k, hs := range s.history {
		n := 0
		for n < len(hs) && !hs[n].expires.After(s.now) {
			ended[hs[n].expires] = true
			n++
		}
		switch {
		case n == len(hs):
			delete(s.history, k)
		case n > 0:
			s.history[k] = slices.Clone(hs[n:])
		}
	}
	s.rev += int64(len(ended))
}

// LastReleased implements records.Store: the end of each address's
// newest interval in history.
func (s *Store) LastReleased(_ context.Context, pool string, addrs []netip.Addr) (map[netip.Addr]time.Time, error) {
	s.lock()
	defer s.mu.Unlock()
	out := map[netip.Addr]time.Time{}
	for _, a := range addrs {
		if hs := s.history[addrKey{pool, a}]; len(hs) > 0 {
			out[a] = hs[len(hs)-1].end
		}
	}
	return out, nil
}
