// Package agent is kvipam's per-node daemon: it holds the node's etcd
// lease, restores the node's blocks and endpoints, and serves the
// unix-socket API (package agent/api) that the CNI plugins call. It is the
// only writer of its node's blocks.
package agent

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/agent/announce"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/netlinkns"
	"github.com/kvipam/kvipam/kvstore"
	"github.com/kvipam/kvipam/routing"
	"github.com/kvipam/kvipam/routing/bgp"
)

// Options are the agent's dependencies that are not configuration.
type Options struct {
	Logger  hclog.Logger
	Version string
	// BootID is the boot ID the agent runs under; empty: the kernel's
	// (/proc/sys/kernel/random/boot_id). Tests set it to stand for
	// another machine.
	BootID string
}

// Agent is one node's daemon: the composition root that builds the parts
// (allocator, group commits, datapath, endpoint manager, lease keeper, etcd
// probe, reconciler, GC collector, peer router, API server) and wires each
// to the few things it needs. Run it once; it is safe for concurrent use
// by its API handlers.
type Agent struct {
	cfg  Config
	opts Options
	log  hclog.Logger
	m    *metrics

	embedded  *kvstore.Embedded
	cli       *clientv3.Client
	store     *etcdstore.Store
	alloc     *nodealloc.Allocator
	batch     *groupCommit[nodealloc.Request, nodealloc.Outcome]
	confirms  *groupCommit[records.Owner, nodealloc.ConfirmOutcome]
	dp        Datapath
	reaper    *linkReaper
	endpoints *endpointManager
	// migrations is the node's side of live migrations (migration.go);
	// guests sees their guests' announcements (nil: none can be seen).
	migrations *migrations
	guests     announce.Watcher
	lease      *leaseKeeper
	probe      *etcdProbe
	recorder   *nodeRecorder
	name       *nameGuard
	rec        *reconciler
	gc         *collector
	exhausted  *exhaustion
	peers      *routing.Peers // nil with routing none
	speaker    *bgp.Speaker   // routing bgp only
	bindings   *nsBindings
	podMTU     int

	ready *readiness
	// testStore, set by a test before Run, wraps the allocator's store.
	testStore storeWrapper
	// knows is the etcd schema this agent understands: this binary's,
	// unless a test standing for an older release set less before Run.
	knows schemaKnowledge
}

// storeWrapper puts a layer between the allocator and etcd: a test puts
// etcd's refusals there (Agent.testStore).
type storeWrapper interface {
	wrap(records.Store) records.Store
}

// New checks cfg and prepares an agent; Run starts it.
func New(cfg Config, o Options) (*Agent, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("invalid configuration: %w", err)
	}
	if o.Logger == nil {
		o.Logger = hclog.NewNullLogger()
	}
	if o.Version == "" {
		o.Version = "dev"
	}
	if o.BootID == "" {
		o.BootID = readBootID()
	}
	a := &Agent{cfg: cfg, opts: o, log: o.Logger, exhausted: &exhaustion{}, knows: thisBinary()}
	a.m = newMetrics(o.Version)
	a.exhausted.errors = a.m.exhausted
	return a, nil
}

// Run starts the agent and blocks until ctx ends, then shuts down. Every
// allocation stays in etcd at shutdown; only the socket goes away.
// ready, if not nil, is closed once the API is served.
func (a *Agent) Run(ctx context.Context, ready chan<- struct{}) error {
	if err := a.start(ctx); err != nil {
		a.shutdown()
		return err
	}
	defer a.shutdown()

	var wg sync.WaitGroup
	bg, stop := context.WithCancel(ctx)
	defer func() { stop(); wg.Wait() }()
	pools := poolWatch{alloc: a.alloc, log: a.log.Named("pools")}
	tasks := []func(context.Context){a.batch.run, a.probe.run, a.maintain, a.reaper.run, a.confirms.run,
		func(ctx context.Context) { a.bindings.run(ctx, a.store) }, func(ctx context.Context) { pools.run(ctx, a.store) },
		func(ctx context.Context) { lentWatch{alloc: a.alloc}.run(ctx, a.store) }, func(ctx context.Context) { a.name.run(ctx, a.store) },
		schemaRaiser{store: a.store, node: a.cfg.Node, version: a.opts.Version, log: a.log.Named("schema")}.run,
		func(ctx context.Context) { a.migrations.run(ctx, a.store) }, a.followGuests, a.followImports}
	// Masquerade follows the pools whatever the routing: under bgp or
	// none a pool masquerades only if an operator turned it on, and a
	// table left from another mode goes.
	egress := newEgressWatch(a.cfg.Routing, a.cfg.Egress.NonMasqueradeCIDRs, nftMasquerader{netns: a.cfg.NetNS}, a.log.Named("egress"))
	tasks = append(tasks, func(ctx context.Context) { egress.run(ctx, a.store) })
	if prog := newRouteProgrammer(&a.cfg, a.log.Named("routing")); prog != nil {
		a.peers = routing.NewPeers(a.cfg.Node, a.cfg.NetNS, a.store, prog, a.log)
		tasks = append(tasks, a.peers.Run)
	}
	if a.speaker != nil {
		src := routing.BGPSources{Homes: a.store, Lease: a.lease, Held: a.alloc}
		tasks = append(tasks, routing.NewAnnouncer(a.cfg.Node, a.recorder.addrs, src, a.speaker, a.speaker.RestartTime(), a.log.Named("bgp")).Run)
	}
	for _, f := range tasks {
		wg.Add(1)
		go func() { defer wg.Done(); f(bg) }()
	}
	srv, ln, err := a.listen()
	if err != nil {
		return err
	}
	var msrv *http.Server
	if a.cfg.MetricsAddr != "" {
		msrv, err = a.serveMetrics()
		if err != nil {
			_ = srv.Close()
			return err
		}
	}
	serveErr := make(chan error, 1)
	go func() { serveErr <- srv.Serve(ln) }()
	if err := a.ready.readyErr(); err != nil {
		a.log.Error("agent serving but not ready", "node", a.cfg.Node, "socket", a.cfg.Socket, "reason", err)
	} else {
		a.log.Info("agent ready", "node", a.cfg.Node, "socket", a.cfg.Socket, "datapath", a.dp.Name(), "version", a.opts.Version)
	}
	if ready != nil {
		close(ready)
	}
	select {
	case <-ctx.Done():
	case err = <-serveErr:
		err = fmt.Errorf("serve api: %w", err)
	}
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = srv.Shutdown(sctx)
	if msrv != nil {
		_ = msrv.Shutdown(sctx)
	}
	_ = os.Remove(a.cfg.Socket)
	a.log.Info("agent stopped; allocations stay in etcd")
	return err
}

// start builds and wires the parts, then makes the first attempt to
// restore blocks and endpoints. A failed restore does not stop the agent:
// it serves not-ready, saying why, and maintain retries.
func (a *Agent) start(ctx context.Context) error {
	if err := a.openEtcd(ctx); err != nil {
		return err
	}
	hist := a.cfg.HistoryRetention.Duration
	if hist == 0 {
		hist = -1 // the store's way to say: no history
	}
	a.store = etcdstore.New(a.cli, etcdstore.Options{ReservationTTL: a.cfg.ReservationTTL.Duration, HistoryRetention: hist, CallTimeout: a.cfg.Etcd.CallTimeout.Duration})
	var store records.Store = instrumentedStore{Store: a.store, m: a.m}
	if a.testStore != nil {
		store = a.testStore.wrap(store)
	}
	var err error
	a.alloc, err = nodealloc.New(nodealloc.Config{
		Node: a.cfg.Node, BootID: a.opts.BootID, Labels: a.cfg.NodeLabels, Logger: a.log,
		Store: store,
		Held: func() []netip.Addr {
			if a.endpoints == nil {
				return nil
			}
			return a.endpoints.records.addrs()
		},
	})
	if err != nil {
		return err
	}
	// A schema this agent does not understand refuses the start before
	// anything is written; then the node's name: another agent holding it
	// refuses the start before anything else is written.
	if err := checkSchema(ctx, a.store, a.knows, a.opts.Version, a.log); err != nil {
		return err
	}
	sess, err := a.takeName(ctx)
	if err != nil {
		return err
	}
	seedPools(ctx, a.store, a.cfg.Pools, a.log.Named("pools"))
	publishHistoryRetention(ctx, a.store, a.cfg.HistoryRetention.Duration, a.cfg.Node, a.log)
	a.batch = newGroupCommit(batchFunc[nodealloc.Request, nodealloc.Outcome](a.alloc.AllocateBatch), a.cfg.MaxBatch, a.cfg.BatchWait.Duration, a.cfg.RequestTimeout.Duration)
	a.batch.sizes = a.m.batch
	if a.dp, err = openDatapath(a.cfg, a.log); err != nil {
		return err
	}
	switch a.cfg.Routing {
	case RoutingVXLAN:
		// Pod packets are encapsulated: the overlay carries the underlay's
		// MTU less the overhead, and a larger pod MTU would send packets
		// it cannot carry.
		limit := detectMTU(0, a.cfg.NetNS) - overlayOverhead(&a.cfg)
		if a.cfg.MTU > limit {
			return fmt.Errorf("%w: mtu %d is more than the vxlan overlay carries (%d: the underlay's less %d)", ErrBadConfig, a.cfg.MTU, limit, overlayOverhead(&a.cfg))
		}
		a.podMTU = cmp.Or(a.cfg.MTU, limit)
	default:
		a.podMTU = detectMTU(a.cfg.MTU, a.cfg.NetNS)
	}
	epRecords, err := openEndpointRecords(filepath.Join(a.cfg.StateDir, "endpoints"))
	if err != nil {
		a.log.Warn("some endpoint records could not be read", "error", err)
	}
	if a.cfg.Routing == RoutingBGP {
		if err := a.startBGP(ctx, a.opts.BootID); err != nil {
			return err
		}
	}
	nl, err := netlinkns.Open(a.cfg.NetNS)
	if err != nil {
		return err
	}
	a.reaper = newLinkReaper(nl, a.cfg.NetNS, a.dp, a.log.Named("reaper"))
	// Confirms are sent as soon as the last batch is done, without a wait.
	a.confirms = newGroupCommit(batchFunc[records.Owner, nodealloc.ConfirmOutcome](a.alloc.ConfirmBatch), a.cfg.MaxBatch, 0, a.cfg.RequestTimeout.Duration)
	a.endpoints = &endpointManager{
		alloc: batchedConfirms{a.alloc, a.confirms}, dp: a.dp, records: epRecords, holders: poolHolders{pools: a.alloc, store: a.store},
		lost: lostReports{recorder: a.recorder, gauge: a.m.lostEPs, lease: a.lease, log: a.log}, reaper: a.reaper,
		freed: a.exhausted, delQueueDir: a.cfg.delQueueDir(), log: a.log, reasserted: a.m.reasserted,
	}
	a.openMigrations()
	a.m.reg.MustRegister(poolCollector{
		usage:  a.alloc,
		blocks: &blockCounts{pools: servedPools{alloc: a.alloc}, store: a.store, ttl: 15 * time.Second},
		leaks:  leakCounter{alloc: a.alloc, endpoints: a.endpoints, grace: a.cfg.GCGrace.Duration},
	})
	// Back in touch with etcd, the endpoints catch up (endpointManager's
	// leaseRenewed and etcdBack).
	a.lease.renewed = a.endpoints
	a.probe = &etcdProbe{store: a.store, log: a.log, back: a.endpoints}
	a.ready = &readiness{name: a.name, probe: a.probe, lease: a.lease}
	a.bindings = newNSBindings()
	a.rec = &reconciler{
		endpoints: a.endpoints, links: a.dp, lapses: a.alloc,
		grace: a.cfg.GCGrace.Duration, interval: a.cfg.GCInterval.Duration, timeout: a.cfg.RequestTimeout.Duration,
		released: a.m.gcReleased.WithLabelValues("reconciler"), log: a.log,
	}
	a.gc = &collector{
		allocs: a.alloc, releaser: a.endpoints, grace: a.cfg.GCGrace.Duration,
		released: a.m.gcReleased.WithLabelValues("gc_request"), log: a.log,
	}
	if err := a.restore(ctx, sess); err != nil {
		a.log.Error("restore failed; serving not-ready and retrying", "error", err)
		a.ready.restoreDone(err)
	}
	return nil
}

// restore rebuilds the allocator's cache on sess, then the endpoints: the
// DELs queued while the agent was away first (their pods' veths are gone,
// and the datapath should not try to adopt them), then adoption of the
// rest. Only then does the agent allocate.
func (a *Agent) restore(ctx context.Context, sess *kvstore.Session) error {
	if err := a.alloc.Restore(ctx, sess); err != nil {
		return fmt.Errorf("restore allocations: %w", err)
	}
	a.endpoints.drainNow(ctx)
	if err := a.endpoints.restore(ctx); err != nil {
		return err
	}
	a.ready.restoreDone(nil)
	return nil
}

// maintain retries a failed restore until it succeeds, then runs the
// reconciler and keeps the lease, until ctx ends.
func (a *Agent) maintain(ctx context.Context) {
	b := backoff.NewExponentialBackOff()
	b.InitialInterval, b.MaxInterval, b.MaxElapsedTime = 200*time.Millisecond, 5*time.Second, 0
	for !a.ready.isRestored() {
		select {
		case <-ctx.Done():
			return
		case <-time.After(b.NextBackOff()):
		}
		// Nothing is restored while another incarnation's record is
		// contested, nor ever once another agent holds the name
		// (identity.go).
		if err := a.name.settle(ctx); err != nil {
			return
		}
		rctx, cancel := context.WithTimeout(ctx, a.cfg.RequestTimeout.Duration)
		sess, err := a.lease.ensure(rctx)
		if err == nil {
			err = a.restore(rctx, sess)
		}
		cancel()
		if errors.Is(err, etcdstore.ErrNodeTaken) || errors.Is(err, errNameContested) {
			b.Reset() // the name guard decides
			continue
		}
		if err == nil {
			a.log.Info("restore succeeded; agent ready", "node", a.cfg.Node)
			break
		}
		a.log.Warn("restore failed again; still not ready", "error", err)
		a.ready.restoreDone(err)
	}
	var wg sync.WaitGroup
	wg.Go(func() { a.rec.run(ctx) })
	wg.Go(func() { a.endpoints.watchQueue(ctx, time.Second, a.ready.readyErr) })
	a.lease.run(ctx)
	wg.Wait()
}

// openEtcd connects to the cluster's etcd, or starts the embedded one
// when the configuration asks for it by name (Validate has made sure it
// says one or the other: there is no fallback to an etcd of our own).
func (a *Agent) openEtcd(ctx context.Context) error {
	cfg := a.cfg.Etcd.Client()
	if a.cfg.Etcd.Embedded {
		dir := filepath.Join(a.cfg.StateDir, "etcd")
		e, err := kvstore.StartEmbedded(ctx, kvstore.EmbedConfig{Dir: dir, ClientURL: a.cfg.EmbeddedListen})
		if err != nil {
			return err
		}
		a.embedded = e
		cfg.Endpoints = e.Endpoints()
		a.log.Info("started embedded etcd", "endpoints", cfg.Endpoints, "dir", dir, "because", "the configuration asks for it (etcd.embedded)")
	}
	cli, err := kvstore.Connect(ctx, cfg, etcdstore.HealthKey())
	if err != nil {
		return err
	}
	a.cli = cli
	return nil
}

func (a *Agent) listen() (*http.Server, net.Listener, error) {
	if err := os.MkdirAll(filepath.Dir(a.cfg.Socket), 0o755); err != nil {
		return nil, nil, fmt.Errorf("create socket dir: %w", err)
	}
	_ = os.Remove(a.cfg.Socket) // a stale socket from a killed agent
	ln, err := net.Listen("unix", a.cfg.Socket)
	if err != nil {
		return nil, nil, fmt.Errorf("listen on %s: %w", a.cfg.Socket, err)
	}
	if err := os.Chmod(a.cfg.Socket, 0o600); err != nil {
		ln.Close()
		return nil, nil, fmt.Errorf("restrict socket: %w", err)
	}
	h := &handlers{
		node: a.cfg.Node, labels: a.cfg.NodeLabels, pools: a.alloc, defaultPool: a.cfg.PoolForRequest(), bindings: a.bindings, podMTU: a.podMTU,
		datapath: a.dp.Name(), resTTL: a.cfg.ReservationTTL.Duration,
		alloc: queuedAllocations{batch: a.batch, migrations: a.alloc}, exhausted: a.exhausted, endpoints: a.endpoints, counters: a.dp,
		garbage: a.gc, owners: a.alloc,
	}
	st := statusReporter{node: a.cfg.Node, version: a.opts.Version, datapath: a.dp.Name(), embedded: a.embedded != nil, etcd: a.cli,
		ready: a.ready, probe: a.probe, lease: a.lease, name: a.name, usage: a.alloc, exhausted: a.exhausted}
	if a.speaker != nil {
		st.bgp = a.speaker
	}
	h.reporter = st
	as := &apiServer{state: a.ready, timeout: a.cfg.RequestTimeout.Duration, requests: a.m.requests, log: a.log, h: h}
	srv := &http.Server{Handler: as.routes(), ReadHeaderTimeout: 5 * time.Second, ErrorLog: a.log.StandardLogger(&hclog.StandardLoggerOptions{InferLevels: true})}
	return srv, ln, nil
}

func (a *Agent) serveMetrics() (*http.Server, error) {
	ln, err := net.Listen("tcp", a.cfg.MetricsAddr)
	if err != nil {
		return nil, fmt.Errorf("listen for metrics on %s: %w", a.cfg.MetricsAddr, err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(a.m.reg, promhttp.HandlerOpts{}))
	mux.Handle("GET /livez", probeHandler(a.cfg.Socket, true))
	mux.Handle("GET /readyz", probeHandler(a.cfg.Socket, false))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	return srv, nil
}

func (a *Agent) shutdown() {
	if a.lease != nil {
		a.lease.close() // no revoke: claims live out their TTL for a quick restart
	}
	// The BGP speaker is not stopped (a Cease would withdraw the routes):
	// its sessions end with the process; routers keep them (wirerouting.go).
	if a.guests != nil {
		_ = a.guests.Close()
	}
	if a.dp != nil {
		_ = a.dp.Close() // closes handles only: pinned eBPF keeps enforcing
	}
	if a.reaper != nil {
		a.reaper.nl.Close()
	}
	if a.store != nil {
		a.store.Close()
	}
	if a.cli != nil {
		a.cli.Close()
	}
	if a.embedded != nil {
		a.embedded.Close()
	}
}
