package agent

import (
	"context"
	"time"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/agent/delqueue"
	"github.com/kvipam/kvipam/allocator/records"
)

// drain applies the DELs plugins queued while the agent was unreachable:
// a DEL the agent never saw would otherwise leak its IPs until GC. It runs
// at start and on every reconciler pass. An entry a later ADD of the same
// owner superseded (queuedDelSuperseded) is dropped without releasing: the
// runtime reused the container ID and interface for a new attachment.
func (m *endpointManager) drain(ctx context.Context) error {
	n, err := delqueue.DrainEntries(ctx, m.delQueueDir, func(ctx context.Context, e delqueue.Entry) error {
		ep, ok := m.records.get(e.Owner)
		if at, later := queuedDelSuperseded(e, ep, ok, m.alloc.Lookup(e.Owner)); later {
			m.log.Info("dropping a queued DEL older than the owner's attachment", "owner", e.Owner.Key(), "queued", e.QueuedAt, "attached", at)
			return nil
		}
		// The sticky identity the DEL names, as the release handler reads
		// it: the allocator drops a binding naming the owner even when
		// it knows nothing of it (a migration's target admitted, its
		// endpoint never made). An entry that names a bad one is
		// released without it.
		var identity string
		if e.Sticky != "" {
			if s, err := stickyOf(e.Owner, e.Sticky, e.IPClaim); err == nil {
				identity = s.Identity
			} else {
				m.log.Warn("queued DEL names no valid sticky identity; released without it", "owner", e.Owner.Key(), "error", err)
			}
		}
		ips, _, err := m.release(ctx, e.Owner, "", identity)
		if err == nil {
			m.log.Info("applied queued DEL", "owner", e.Owner.Key(), "released", ips)
		}
		return err
	})
	if n > 0 {
		m.log.Info("drained DEL queue", "applied", n)
	}
	return err
}

// queuedDelSuperseded reports whether an ADD of e's owner came after e was
// queued, and when: the owner's endpoint was created after it, or, with
// no endpoint yet, the owner holds a reservation made after it (an ADD
// between its allocation and its endpoint). An allocation's Since is not
// enough: a live migration's cut-over or hand-over, and a sticky
// identity's, move it to an owner whose pod made no ADD then, and a DEL
// queued by that pod before the hand-over must still be applied (a
// chaos run: a target's DEL queued across an agent restart, then the
// forwarding owner's DEL handed the addresses to it, and the queued DEL
// was dropped as stale: a leak).
func queuedDelSuperseded(e delqueue.Entry, ep api.Endpoint, hasEndpoint bool, held []records.Allocation) (time.Time, bool) {
	if e.QueuedAt.IsZero() {
		return time.Time{}, false
	}
	if hasEndpoint {
		return ep.Created, ep.Created.After(e.QueuedAt)
	}
	for _, al := range held {
		if al.State == records.StateReserved && al.Since.After(e.QueuedAt) {
			return al.Since, true
		}
	}
	return time.Time{}, false
}

// drainNow applies the queued DELs at once (at start, and when etcd or
// the lease comes back) rather than at the reconciler's next pass; what
// fails stays queued for that pass, and what cannot be read is set aside
// (delqueue.RejectedDir) and reported here once.
func (m *endpointManager) drainNow(ctx context.Context) {
	if err := m.drain(ctx); err != nil {
		m.log.Warn("queued DELs not applied (failed ones stay queued, unreadable ones are set aside)", "error", err)
	}
}

// watchQueue applies DELs queued while the agent runs, every interval: a
// plugin that found the agent restarting queues its DEL, perhaps after
// the drain at start. A look at an empty queue is one directory read.
// While ready says no (etcd unreachable, the lease lost) it waits: the
// drain on etcd's or the lease's return comes first.
func (m *endpointManager) watchQueue(ctx context.Context, interval time.Duration, ready func() error) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if pending, err := delqueue.Pending(m.delQueueDir); err == nil && pending && ready() == nil {
			m.drainNow(ctx)
		}
	}
}

// leaseRenewed runs once a lost lease was replaced and the blocks
// re-claimed: the DELs plugins queued meanwhile go first (their pods are
// gone: re-asserting them would bring them back), then the endpoints are
// checked against etcd.
func (m *endpointManager) leaseRenewed(ctx context.Context) {
	m.drainNow(ctx)
	m.recheck(ctx)
}

// etcdBack runs when etcd answers again after it did not (it may have
// been restored meanwhile): queued DELs first, then the endpoints are
// compared with etcd and what it lost is re-asserted.
func (m *endpointManager) etcdBack(ctx context.Context) {
	m.drainNow(ctx)
	m.verify(ctx)
}
