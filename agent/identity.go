package agent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/kvstore"
	"github.com/kvipam/kvipam/routing"
)

// One name, one agent (docs/design.md, invariant 9). An agent is one
// incarnation of its node's name: its machine's boot ID and its node
// addresses. Its node record is written only through etcdstore.WriteNode,
// which never replaces another incarnation's record, so:
//
//   - at start, while another incarnation's record lives (on that agent's
//     lease), the first write is refused and the agent refuses to start,
//     before it claims, restores or writes anything else;
//   - running, it meets another incarnation's record when a write of its
//     record is refused (a new lease after a partition longer than the
//     TTL, during which another agent started under the name) or when its
//     watch of the record sees one (written without the fence, by an
//     older version; or brought back by an etcd restore from a snapshot
//     taken before this machine's last reboot: its own earlier boot's
//     record, on that boot's lease, which etcd revives for one TTL).
//
// A record met while running is only contested until its lease is seen
// renewed (namecontest.go): meanwhile the agent serves no new ADDs
// (try again: it may pass by itself), takes no lease and writes nothing.
// Renewed, or rewritten, an agent keeps it alive: the name is taken, and
// the agent stops for good: no new ADD, no new lease, no restore, so it
// never re-claims the node's blocks, even once the other agent is gone.
// Its pods keep running and DELs go on (releases are fenced). Only a
// restart brings it back, through the start's check: the name's blocks
// and addresses may have changed hands meanwhile, and only a fresh
// restore, with its lost-endpoint report, tells what is still this
// node's. Gone with its lease, never renewed, the record was nobody's:
// the agent takes its name back as after any lost lease (a new lease, its
// record, a restore).

// takeName builds the node record's writer, the name guard and the lease
// keeper, and takes the node's name: the first node lease, with the node
// record written on it. Another agent holding the name refuses the start;
// once this agent holds it, it is running, and another incarnation's
// record met later is contested (nameGuard.found).
func (a *Agent) takeName(ctx context.Context) (*kvstore.Session, error) {
	a.recorder = &nodeRecorder{store: a.store, node: a.cfg.Node, bootID: a.opts.BootID, version: a.opts.Version,
		addrs: routing.NodeAddresses(a.cfg.NodeAddresses, a.cfg.NetNS), labels: a.cfg.NodeLabels, started: time.Now().UTC(),
		features: a.knows.features}
	a.name = newNameGuard(a.recorder.incarnation(), a.m.nameTaken, a.log, a.cfg.RequestTimeout.Duration)
	a.recorder.name = a.name
	a.lease = &leaseKeeper{
		leases: nodeLeases{cli: a.cli, ttl: int64(a.cfg.LeaseTTL.Seconds()), recorder: a.recorder}, alloc: a.alloc, name: a.name,
		timeout: a.cfg.RequestTimeout.Duration, held: a.m.leaseHeld, log: a.log,
	}
	a.name.lease = a.lease
	sess, err := a.lease.ensure(ctx)
	if errors.Is(err, etcdstore.ErrNodeTaken) {
		return nil, fmt.Errorf("refusing to start: %w: give this agent a name of its own (--node), "+
			"or stop the other agent and start this one once the other's lease has ended (at most the lease TTL); "+
			"if the other is this machine's own earlier boot (the same addresses, an older start: a reboot within the TTL, "+
			"or an etcd restore from a snapshot taken before the reboot), nobody keeps its lease alive, "+
			"and this refusal passes within that TTL, through the supervisor's restarts", err)
	}
	if err == nil {
		a.name.serving.Store(true)
	}
	return sess, err
}

// nameGuard is the running agent's side of the invariant, and the one
// place that decides whether another incarnation holds the node's name.
// Told of another incarnation's record (found), it contests it until its
// lease is seen renewed or gone (run, namecontest.go). Taken, it says so
// (an ERROR line naming both, the kvipam_node_name_conflict gauge,
// readiness, the status API) and drops the node lease. It is safe for
// concurrent use.
type nameGuard struct {
	// self is this agent's incarnation as its node record says it.
	self  etcdstore.NodeRecord
	gauge prometheus.Gauge
	log   hclog.Logger
	// lease is the node lease. Taken, it is revoked: the node's claims
	// go with it, and the allocator, whose session it is, writes nothing
	// more. Won back, it is renewed (retake).
	lease interface {
		session() *kvstore.Session
		retake()
	}
	// timeout bounds each etcd call of the guard.
	timeout time.Duration
	// interval is the time between two looks at a contested record.
	interval time.Duration
	// serving is set once the agent has taken its name at start: before,
	// another incarnation's record refuses the start.
	serving atomic.Bool
	// wake tells run that a contest began, or that the record went.
	wake chan struct{}

	mu    sync.Mutex
	taken *etcdstore.NodeTakenError
	since time.Time
	// contest is another incarnation's record, while it is contested;
	// settled is closed when the contest ends.
	contest      *etcdstore.NodeTakenError
	contestSince time.Time
	settled      chan struct{}
}

// contestInterval is how often a contested record is looked at: the
// bound, beyond the record's lease TTL, of how long a contest lasts.
const contestInterval = time.Second

func newNameGuard(self etcdstore.NodeRecord, gauge prometheus.Gauge, log hclog.Logger, timeout time.Duration) *nameGuard {
	return &nameGuard{self: self, gauge: gauge, log: log, timeout: timeout, interval: contestInterval, wake: make(chan struct{}, 1)}
}

// errNameContested marks why the agent serves no new ADDs while another
// incarnation's record is contested: try again, it may pass by itself.
var errNameContested = errors.New("node name contested")

// err is why the agent serves no new ADDs: the name taken (it wraps
// etcdstore.ErrNodeTaken) or contested (errNameContested); nil while
// the name is this agent's.
func (g *nameGuard) err() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	switch {
	case g.taken != nil:
		return fmt.Errorf("%w: this agent serves no new ADDs and claims nothing until it is restarted; "+
			"give one of the two a name of its own (--node), then restart this one", g.taken)
	case g.contest != nil:
		h := g.contest.Holder
		return fmt.Errorf("%w (node %q): another incarnation's record is on lease %x; waiting to see whether an agent keeps it alive "+
			"(that record: %s, started %s; this agent: %s): no new ADDs until the lease is renewed (another agent holds the name) "+
			"or ends unrenewed (nobody's, as an etcd restore from a snapshot taken before this machine's last reboot brings its earlier boot's back "+
			"for one TTL), then this agent takes its name back",
			errNameContested, h.Name, h.Lease, h.Incarnation(), h.StartedAt.Format(time.RFC3339), g.self.Incarnation())
	}
	return nil
}

// found is told of another incarnation's record. At start it is taken
// (the start is refused), and so is a record on no lease, which nothing
// ends; running, it is contested until its lease is seen renewed or
// gone; a record rewritten while contested was rewritten by an agent.
func (g *nameGuard) found(e *etcdstore.NodeTakenError) {
	switch {
	case !g.serving.Load():
		g.latch(e, "held at start")
		return
	case e.Holder.Lease == 0:
		g.latch(e, "its record is on no lease, which nothing ends")
		return
	}
	g.mu.Lock()
	switch {
	case g.taken != nil:
		g.mu.Unlock()
	case g.contest == nil:
		g.contest, g.contestSince, g.settled = e, time.Now().UTC(), make(chan struct{})
		g.mu.Unlock()
		h := e.Holder
		g.log.Warn("another incarnation's record holds this node's name; serving no new ADDs until its lease is seen renewed "+
			"(another agent: the name is taken) or ending unrenewed (nobody's: the name is taken back)", "node", h.Name,
			"holder_boot_id", h.BootID, "holder_addresses", h.Addresses, "holder_version", h.Version,
			"holder_started", h.StartedAt.Format(time.RFC3339), "holder_lease", fmt.Sprintf("%x", h.Lease),
			"boot_id", g.self.BootID, "addresses", g.self.Addresses)
		g.nudge()
	case g.contest.Holder.Revision != e.Holder.Revision:
		g.mu.Unlock()
		g.latch(e, "its record was rewritten while contested")
	default:
		g.mu.Unlock() // the contested record, seen again
	}
}

// latch records that the name is taken, once, and ends a contest.
func (g *nameGuard) latch(e *etcdstore.NodeTakenError, evidence string) {
	g.mu.Lock()
	first := g.taken == nil
	if first {
		g.taken, g.since = e, time.Now().UTC()
		g.endContest()
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
		"boot_id", g.self.BootID, "addresses", g.self.Addresses, "evidence", evidence, "action", action)
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

// release ends contest c, if it is still the one: the record went with
// its lease, never renewed. The lease keeper takes the name back.
func (g *nameGuard) release(c *etcdstore.NodeTakenError) {
	g.mu.Lock()
	if g.contest != c {
		g.mu.Unlock()
		return
	}
	g.endContest()
	since := g.contestSince
	g.mu.Unlock()
	h := c.Holder
	g.log.Info("another incarnation's record went with its lease, never renewed: nobody's; taking the node's name back "+
		"(a new lease, the node record, a restore)", "node", h.Name, "holder_boot_id", h.BootID, "holder_addresses", h.Addresses,
		"holder_started", h.StartedAt.Format(time.RFC3339), "holder_lease", fmt.Sprintf("%x", h.Lease),
		"contested_for", time.Since(since).Round(time.Millisecond))
	if g.lease != nil {
		g.lease.retake()
	}
}

// endContest ends the contest, if any; g.mu is held.
func (g *nameGuard) endContest() {
	if g.contest != nil {
		close(g.settled)
		g.contest, g.settled = nil, nil
	}
}

// settle waits while the name is contested. It returns nil when the name
// is this agent's to take, the name's error once it is taken, or ctx's.
func (g *nameGuard) settle(ctx context.Context) error {
	for {
		g.mu.Lock()
		taken, settled := g.taken != nil, g.settled
		g.mu.Unlock()
		switch {
		case taken:
			return g.err()
		case settled == nil:
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-settled:
		}
	}
}

// seen checks an error of a node record write: another incarnation's
// record is found.
func (g *nameGuard) seen(err error) {
	var te *etcdstore.NodeTakenError
	if errors.As(err, &te) {
		g.found(te)
	}
}

// status is the conflict for the status API: who holds the name (nil
// while nobody does) and whose record is contested (nil while none is).
func (g *nameGuard) status() (*api.NameTaken, *api.NameContested) {
	g.mu.Lock()
	defer g.mu.Unlock()
	inc := func(r etcdstore.NodeRecord) api.Incarnation {
		return api.Incarnation{BootID: r.BootID, Addresses: r.Addresses, Version: r.Version, StartedAt: r.StartedAt, Lease: r.Lease}
	}
	switch {
	case g.taken != nil:
		self := inc(g.taken.Mine)
		self.Lease = 0 // this agent holds no lease any more
		return &api.NameTaken{Since: g.since, Holder: inc(g.taken.Holder), Self: self}, nil
	case g.contest != nil:
		return nil, &api.NameContested{Since: g.contestSince, Holder: inc(g.contest.Holder)}
	}
	return nil, nil
}

// Reset, Put and Delete make nameGuard the handler of its watch of the
// node's record (run).
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

// Delete is the record gone with its lease: a contested one is looked at
// at once; this agent's own is written again by the lease keeper on its
// next lease.
func (g *nameGuard) Delete(etcdstore.NodeRecord) { g.nudge() }

// nudge wakes run.
func (g *nameGuard) nudge() {
	select {
	case g.wake <- struct{}{}:
	default:
	}
}

// readBootID is the kernel's boot ID, "" when it cannot be read.
func readBootID() string {
	b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}
