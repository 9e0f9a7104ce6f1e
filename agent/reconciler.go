package agent

import (
	"context"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvipam/kvipam/agent/api"
)

// reconciler is the agent's own leak GC: an endpoint whose host interface
// has vanished (its pod netns was deleted without a DEL) is suspected at
// one pass and released at a later pass at least the grace period after,
// if the interface is still gone. Each pass first applies queued DELs. It
// starts only after restore, and is driven by one goroutine.
type reconciler struct {
	endpoints interface {
		list() []api.Endpoint
		releaseEndpoint(ctx context.Context, ep api.Endpoint) (ips []string, same bool, err error)
		// drain applies the DELs queued by plugins.
		drain(ctx context.Context) error
		// verify compares the endpoints with etcd and re-asserts what
		// etcd lost (reassert.go).
		verify(ctx context.Context)
	}
	links interface {
		HostLinkExists(ep api.Endpoint) (bool, error)
	}
	// lapses, if set, writes reservations seen to lapse to IP history.
	lapses interface {
		RecordLapses(ctx context.Context) error
	}
	grace    time.Duration
	interval time.Duration
	timeout  time.Duration
	released prometheus.Counter
	log      hclog.Logger

	suspect map[string]time.Time
}

func (r *reconciler) run(ctx context.Context) {
	t := time.NewTicker(r.interval)
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
	if r.suspect == nil {
		r.suspect = map[string]time.Time{}
	}
	if err := r.endpoints.drain(ctx); err != nil {
		r.log.Warn("reconcile: DEL queue", "error", err)
	}
	released := 0
	seen := map[string]bool{}
	for _, ep := range r.endpoints.list() {
		k := ep.Owner.Key()
		seen[k] = true
		exists, err := r.links.HostLinkExists(ep)
		if err != nil {
			r.log.Debug("reconcile: cannot check endpoint", "owner", k, "error", err)
			continue
		}
		if exists {
			delete(r.suspect, k)
			continue
		}
		first, ok := r.suspect[k]
		if !ok {
			r.suspect[k] = now
			r.log.Info("endpoint's host interface is gone; releasing after the grace period", "owner", k, "host_if", ep.HostIfName, "grace", r.grace)
			continue
		}
		if now.Sub(first) < r.grace {
			continue
		}
		rctx, cancel := context.WithTimeout(ctx, r.timeout)
		ips, same, err := r.endpoints.releaseEndpoint(rctx, ep)
		cancel()
		if err != nil {
			r.log.Warn("reconcile: release", "owner", k, "error", err)
			continue
		}
		delete(r.suspect, k)
		if !same {
			// DEL and a new ADD of the same attachment came in between:
			// the new endpoint is judged on its own at a later pass.
			continue
		}
		released++
		r.released.Add(float64(len(ips)))
		r.log.Info("released the IPs of a vanished endpoint", "owner", k, "ips", ips)
	}
	for k := range r.suspect {
		if !seen[k] {
			delete(r.suspect, k)
		}
	}
	rctx, cancel := context.WithTimeout(ctx, r.timeout)
	r.endpoints.verify(rctx)
	cancel()
	if r.lapses != nil {
		rctx, cancel := context.WithTimeout(ctx, r.timeout)
		if err := r.lapses.RecordLapses(rctx); err != nil {
			r.log.Warn("reconcile: IP history of lapsed reservations", "error", err)
		}
		cancel()
	}
	return released
}
