package agent

import (
	"context"
	"time"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/agent/delqueue"
	"github.com/kvipam/kvipam/allocator"
)

// collect serves a GC request: this node's allocations (in req.Pool, or
// every pool) whose owner is not a valid attachment are released, but only
// once the node has known them for the grace period (on the monotonic
// clock, so a step of the wall clock cannot make a fresh allocation look
// old), so an ADD that raced the caller's list of valid attachments is not
// collected. Each release is guarded in etcd by the revision seen in the
// snapshot GC decided on.
func (a *Agent) collect(ctx context.Context, req api.GCRequest, now time.Time) (api.GCResponse, error) {
	valid := map[string]bool{}
	for _, at := range req.ValidAttachments {
		valid[at.ContainerID+"/"+at.IfName] = true
	}
	var doomed []allocator.Allocation
	res := api.GCResponse{Released: []string{}}
	for _, al := range a.alloc.Allocations() {
		if (req.Pool != "" && al.Pool != req.Pool) || (req.Network != "" && al.Network != req.Network) || valid[al.Owner.Key()] {
			continue
		}
		if now.Sub(al.Seen) < a.cfg.GCGrace.Duration {
			res.Deferred++
			continue
		}
		doomed = append(doomed, al)
	}
	if a.testHookGCDecided != nil {
		a.testHookGCDecided()
	}
	released, err := a.releaseIPs(ctx, doomed)
	res.Released = append(res.Released, released...)
	a.m.gcReleased.WithLabelValues("gc_request").Add(float64(len(released)))
	if len(released) > 0 {
		a.log.Info("gc released allocations", "count", len(released), "ips", released, "deferred", res.Deferred)
	}
	return res, err
}

// reconciler is the agent's own leak GC: an endpoint whose host interface
// has vanished (its pod netns was deleted without a DEL) is suspected at
// one pass and released at a later pass at least the grace period after,
// if the interface is still gone. It starts only after restore.
type reconciler struct {
	a       *Agent
	suspect map[string]time.Time
}

func newReconciler(a *Agent) *reconciler {
	return &reconciler{a: a, suspect: map[string]time.Time{}}
}

func (r *reconciler) run(ctx context.Context) {
	t := time.NewTicker(r.a.cfg.GCInterval.Duration)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			r.pass(ctx, now)
		}
	}
}

// pass is one reconciliation; it returns how many owners it released.
func (r *reconciler) pass(ctx context.Context, now time.Time) int {
	if err := r.a.drainDelQueue(ctx); err != nil {
		r.a.log.Warn("reconcile: DEL queue", "error", err)
	}
	released := 0
	seen := map[string]bool{}
	for _, ep := range r.a.eps.list() {
		k := ep.Owner.Key()
		seen[k] = true
		exists, err := r.a.dp.HostLinkExists(ep)
		if err != nil {
			r.a.log.Debug("reconcile: cannot check endpoint", "owner", k, "error", err)
			continue
		}
		if exists {
			delete(r.suspect, k)
			continue
		}
		first, ok := r.suspect[k]
		if !ok {
			r.suspect[k] = now
			r.a.log.Info("endpoint's host interface is gone; releasing after the grace period", "owner", k, "host_if", ep.HostIfName, "grace", r.a.cfg.GCGrace)
			continue
		}
		if now.Sub(first) < r.a.cfg.GCGrace.Duration {
			continue
		}
		rctx, cancel := context.WithTimeout(ctx, r.a.cfg.RequestTimeout.Duration)
		ips, same, err := r.a.releaseEndpoint(rctx, ep)
		cancel()
		if err != nil {
			r.a.log.Warn("reconcile: release", "owner", k, "error", err)
			continue
		}
		if !same {
			// DEL and a new ADD of the same attachment came in between:
			// the new endpoint is judged on its own at a later pass.
			delete(r.suspect, k)
			continue
		}
		delete(r.suspect, k)
		released++
		r.a.m.gcReleased.WithLabelValues("reconciler").Add(float64(len(ips)))
		r.a.log.Info("released the IPs of a vanished endpoint", "owner", k, "ips", ips)
	}
	for k := range r.suspect {
		if !seen[k] {
			delete(r.suspect, k)
		}
	}
	return released
}

// drainDelQueue applies the DELs plugins queued while the agent was
// unreachable: a DEL the agent never saw would otherwise leak its IPs
// until GC. It runs at start and on every reconciler pass. An entry older
// than the owner's current allocation is dropped without releasing: the
// runtime reused the container ID and interface for a new attachment.
func (a *Agent) drainDelQueue(ctx context.Context) error {
	n, err := delqueue.DrainEntries(ctx, a.cfg.delQueueDir(), func(ctx context.Context, e delqueue.Entry) error {
		for _, al := range a.alloc.Lookup(toOwner(e.Owner)) {
			if !e.QueuedAt.IsZero() && al.Since.After(e.QueuedAt) {
				a.log.Info("dropping a queued DEL older than the owner's allocation", "owner", e.Owner.Key(), "queued", e.QueuedAt, "allocated", al.Since)
				return nil
			}
		}
		ips, err := a.release(ctx, e.Owner)
		if err == nil {
			a.log.Info("applied queued DEL", "owner", e.Owner.Key(), "released", ips)
		}
		return err
	})
	if n > 0 {
		a.log.Info("drained DEL queue", "applied", n)
	}
	return err
}
