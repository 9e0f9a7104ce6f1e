package agent

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/kvstore"
)

// One name, one agent (docs/design.md, invariant 9). An agent is one
// incarnation of its node's name: its machine's boot ID and its node
// addresses. Its node record is written only through etcdstore.WriteNode,
// which never replaces another incarnation's record, so:
//
//   - at start, while another incarnation's record lives (on that agent's
//     lease), the first write is refused and the agent refuses to start,
//     before it claims, restores or writes anything else;
//   - running, it finds the name taken when a write of its record is
//     refused (a new lease after a partition longer than the TTL, during
//     which another agent started under the name), or when its watch of
//     the record sees another incarnation's (written without the fence,
//     by an older version). It then stops for good: no new ADD, no new
//     lease, no restore, so it never re-claims the node's blocks, even
//     once the other agent is gone. Its pods keep running and DELs go on
//     (releases are fenced). Only a restart brings it back, through the
//     start's check: the name's blocks and addresses may have changed
//     hands meanwhile, and only a fresh restore, with its lost-endpoint
//     report, tells what is still this node's.

// takeName builds the node record's writer, the name guard and the lease
// keeper, and takes the node's name: the first node lease, with the node
// record written on it. Another agent holding the name refuses the start.
func (a *Agent) takeName(ctx context.Context) (*kvstore.Session, error) {
	a.recorder = &nodeRecorder{store: a.store, node: a.cfg.Node, bootID: a.opts.BootID, version: a.opts.Version,
		addrs: nodeAddresses(a.cfg.NodeAddresses, a.cfg.NetNS), labels: a.cfg.NodeLabels, started: time.Now().UTC()}
	a.name = &nameGuard{self: a.recorder.incarnation(), gauge: a.m.nameTaken, log: a.log, timeout: a.cfg.RequestTimeout.Duration}
	a.recorder.name = a.name
	a.lease = &leaseKeeper{
		leases: nodeLeases{cli: a.cli, ttl: int64(a.cfg.LeaseTTL.Seconds()), recorder: a.recorder}, alloc: a.alloc, timeout: a.cfg.RequestTimeout.Duration,
		held: a.m.leaseHeld, log: a.log,
	}
	a.name.lease = a.lease
	sess, err := a.lease.ensure(ctx)
	if errors.Is(err, etcdstore.ErrNodeTaken) {
		return nil, fmt.Errorf("refusing to start: %w: give this agent a name of its own (--node), "+
			"or stop the other agent and start this one once the other's lease has ended (at most the lease TTL)", err)
	}
	return sess, err
}

// nameGuard is the running agent's side of the invariant: it remembers
// that another incarnation holds the node's name, says so (an ERROR line
// naming both, the kvipam_node_name_conflict gauge, readiness, the status
// API) and drops the node lease. It is safe for concurrent use.
type nameGuard struct {
	// self is this agent's incarnation as its node record says it.
	self  etcdstore.NodeRecord
	gauge prometheus.Gauge
	log   hclog.Logger
	// lease is the node lease, revoked when the name is found taken:
	// the node's claims go with it, and the allocator, whose session it
	// is, writes nothing more.
	lease interface{ session() *kvstore.Session }
	// timeout bounds the revoke.
	timeout time.Duration
	// serving is set once the agent has started: before, a taken name
	// refuses the start.
	serving atomic.Bool

	mu    sync.Mutex
	taken *etcdstore.NodeTakenError
	since time.Time
}

// err is why the agent serves no new ADDs: the name taken (it wraps
// etcdstore.ErrNodeTaken), nil while the name is this agent's.
func (g *nameGuard) err() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.taken == nil {
		return nil
	}
	return fmt.Errorf("%w: this agent serves no new ADDs and claims nothing until it is restarted; "+
		"give one of the two a name of its own (--node), then restart this one", g.taken)
}

// found records that the name is taken, once.
func (g *nameGuard) found(e *etcdstore.NodeTakenError) {
	g.mu.Lock()
	first := g.taken == nil
	if first {
		g.taken, g.since = e, time.Now().UTC()
	}
	g.mu.Unlock()
	if !first {
		return
	}
	g.gauge.Set(1)
	action := "refusing to start"
	if g.serving.Load() {
		action = "serving no new ADDs and claiming nothing until restarted"
	}
	h := e.Holder
	g.log.Error("another agent holds this node's name; node names must be unique (kvipam-agent --node)", "node", h.Name,
		"holder_boot_id", h.BootID, "holder_addresses", h.Addresses, "holder_version", h.Version,
		"holder_started", h.StartedAt.Format(time.RFC3339), "holder_lease", fmt.Sprintf("%x", h.Lease),
		"boot_id", g.self.BootID, "addresses", g.self.Addresses, "action", action)
	if g.lease == nil {
		return
	}
	if s := g.lease.session(); s != nil && !s.Lost() {
		ctx, cancel := context.WithTimeout(context.Background(), g.timeout)
		defer cancel()
		if err := s.Revoke(ctx); err != nil {
			g.log.Warn("cannot revoke the node lease; it ends with its TTL", "error", err)
		}
	}
}

// seen checks an error of a node record write: a taken name is found.
func (g *nameGuard) seen(err error) {
	var te *etcdstore.NodeTakenError
	if errors.As(err, &te) {
		g.found(te)
	}
}

// status is the conflict for the status API, nil while there is none.
func (g *nameGuard) status() *api.NameTaken {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.taken == nil {
		return nil
	}
	inc := func(r etcdstore.NodeRecord) api.Incarnation {
		return api.Incarnation{BootID: r.BootID, Addresses: r.Addresses, Version: r.Version, StartedAt: r.StartedAt, Lease: r.Lease}
	}
	self := inc(g.taken.Mine)
	self.Lease = 0 // this agent holds no lease any more
	return &api.NameTaken{Since: g.since, Holder: inc(g.taken.Holder), Self: self}
}

// watch follows the node's record until ctx ends: a record of another
// incarnation, written without the fence, means the name is taken.
func (g *nameGuard) watch(ctx context.Context, st interface {
	WatchNode(ctx context.Context, node string, h etcdstore.Handler[etcdstore.NodeRecord]) error
}) {
	_ = st.WatchNode(ctx, g.self.Name, g)
}

// Reset, Put and Delete make nameGuard the watch's handler.
func (g *nameGuard) Reset(all []etcdstore.NodeRecord) {
	for _, r := range all {
		g.Put(r)
	}
}

func (g *nameGuard) Put(r etcdstore.NodeRecord) {
	if !r.SameIncarnation(g.self) {
		g.found(&etcdstore.NodeTakenError{Mine: g.self, Holder: r})
	}
}

// Delete is the record gone with its lease: the lease keeper writes it
// again on its next lease, through the fence.
func (g *nameGuard) Delete(etcdstore.NodeRecord) {}
