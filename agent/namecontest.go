package agent

import (
	"context"
	"sync"
	"time"

	"github.com/kvipam/kvipam/allocator/etcdstore"
)

// A contest: another incarnation's record, met by a running agent, is
// another agent's only if an agent keeps it alive. Its lease is renewed
// by that agent's keepalives (at least once per TTL, etcd's client every
// third of it); a record nobody renews, such as the one an etcd restore
// brings back from a machine's earlier boot, goes with its lease within
// one TTL. So the guard looks at the record and its lease every interval:
//
//   - the record gone (or this agent's again), or its lease gone: it was
//     nobody's, and the agent takes its name back (release);
//   - the record rewritten (another revision, still another
//     incarnation's): an agent wrote it, the name is taken;
//   - the lease's remaining TTL higher than it can be unless renewed,
//     against the first reading of the same raft term (renewed): an
//     agent keeps it alive, the name is taken.
//
// A contest thus lasts at most the record's lease TTL and one interval
// when nobody renews it, and about one renewal period and one interval
// when an agent does.

// nodeRecords is what the name guard reads of etcd: the node's record,
// followed and read once, and a lease's remaining TTL.
type nodeRecords interface {
	WatchNode(ctx context.Context, node string, h etcdstore.Handler[etcdstore.NodeRecord]) error
	ReadNode(ctx context.Context, node string) (etcdstore.NodeRecord, bool, error)
	ReadLeaseTTL(ctx context.Context, lease int64) (etcdstore.LeaseTTL, error)
}

var _ nodeRecords = (*etcdstore.Store)(nil)

// run follows the node's record and settles each contest, until ctx
// ends.
func (g *nameGuard) run(ctx context.Context, st nodeRecords) {
	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Go(func() { _ = st.WatchNode(ctx, g.self.Name, g) })
	for {
		select {
		case <-ctx.Done():
			return
		case <-g.wake:
		}
		g.mu.Lock()
		c := g.contest
		g.mu.Unlock()
		if c != nil {
			g.probe(ctx, st, c)
		}
	}
}

// verdict is what one look at a contested record found.
type verdict int

const (
	undecided verdict = iota
	holderGone
	holderLive
)

// probe looks at contest c's record every interval (and when the watch
// sees it go) until it is decided, or the contest ended otherwise.
func (g *nameGuard) probe(ctx context.Context, st nodeRecords, c *etcdstore.NodeTakenError) {
	g.mu.Lock()
	settled := g.settled
	g.mu.Unlock()
	if settled == nil {
		return
	}
	var first *leaseReading
	t := time.NewTicker(g.interval)
	defer t.Stop()
	for {
		v, holder, evidence := g.look(ctx, st, c.Holder, &first)
		switch v {
		case holderGone:
			g.release(c)
			return
		case holderLive:
			g.latch(&etcdstore.NodeTakenError{Mine: g.self, Holder: holder}, evidence)
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-settled:
			return
		case <-g.wake:
		case <-t.C:
		}
	}
}

// look reads the record held is contested for and its lease once. first
// is the first reading of the lease in the current raft term.
func (g *nameGuard) look(ctx context.Context, st nodeRecords, held etcdstore.NodeRecord, first **leaseReading) (verdict, etcdstore.NodeRecord, string) {
	ctx, cancel := context.WithTimeout(ctx, g.timeout)
	defer cancel()
	rec, ok, err := st.ReadNode(ctx, g.self.Name)
	switch {
	case err != nil:
		g.log.Debug("read the contested node record", "error", err)
		return undecided, held, ""
	case !ok || rec.SameIncarnation(g.self):
		return holderGone, held, ""
	case rec.Revision != held.Revision:
		return holderLive, rec, "its record was rewritten while contested"
	}
	sent := time.Now()
	l, err := st.ReadLeaseTTL(ctx, rec.Lease)
	answered := time.Now()
	switch {
	case err != nil:
		g.log.Debug("read the contested record's lease", "lease", rec.Lease, "error", err)
		return undecided, held, ""
	case !l.Found:
		return holderGone, held, ""
	}
	r := leaseReading{ttl: l.Remaining, term: l.Term, sent: sent, answered: answered}
	if *first == nil || (*first).term != r.term {
		*first = &r
		return undecided, held, ""
	}
	if renewed(**first, r) {
		return holderLive, rec, "its lease was renewed while contested"
	}
	return undecided, held, ""
}

// leaseReading is one reading of a lease's remaining TTL: etcd's whole
// seconds, the raft term it was read in, and when it was asked for and
// answered.
type leaseReading struct {
	ttl            int64
	term           uint64
	sent, answered time.Time
}

// renewed reports whether b, a later reading of a's lease in a's raft
// term, proves that the lease was renewed between them. etcd truncates
// the remaining TTL r to whole seconds (v <= r < v+1 for r >= 0), and
// without a renewal the lease's r falls as time passes, at least by e,
// the time from a's answer to b's asking: so b's r is below a.ttl+1-e,
// and b.ttl+e >= a.ttl+1 cannot hold. b must read at least a second:
// a lease etcd let expire but has not yet revoked reads 0 or less. A
// higher TTL than a's is the common proof (a renewal since); a lease that
// outlives a's reading by more than a second is the proof when the
// renewals come faster than etcd's rounding shows (a 2 s lease renewed
// every 0.7 s always reads 1).
func renewed(a, b leaseReading) bool {
	e := b.sent.Sub(a.answered)
	return b.ttl >= 1 && time.Duration(b.ttl)*time.Second+e >= time.Duration(a.ttl+1)*time.Second
}
