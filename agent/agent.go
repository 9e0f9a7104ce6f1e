// Package agent is kvipam's per-node daemon: it holds the node's etcd
// lease, restores the node's blocks and endpoints, and serves the
// unix-socket API (package agent/api) that the CNI plugins call. It is the
// only writer of its node's blocks.
package agent

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/kvstore"
)

// Options are the agent's dependencies that are not configuration.
type Options struct {
	Logger  hclog.Logger
	Version string
}

// Agent is one node's daemon. Run it once; it is safe for concurrent use
// by its API handlers.
type Agent struct {
	cfg  Config
	opts Options
	log  hclog.Logger

	embedded *kvstore.Embedded
	cli      *clientv3.Client
	store    *etcdstore.Store
	alloc    *allocator.NodeAllocator
	eps      *endpointStore
	dp       Datapath
	m        *metrics
	batch    *batcher
	bootID   string
	podMTU   int

	mu        sync.Mutex
	sess      *kvstore.Session
	etcdErr   error
	exhausted map[string]bool // pool/family whose last claim found no block
	restored  bool
	// restoreErr is why the last restore failed, while not restored.
	restoreErr error
	gc         *reconciler
	lost       []etcdstore.LostEndpoint // found since start; in the node record

	// epMu serializes endpoint create/delete/release per agent: they
	// touch the datapath and the record together.
	epMu sync.Mutex

	// testHookGCDecided, if set, runs between GC's choice of what to
	// release and the releases, so a test can interleave a DEL and an ADD.
	testHookGCDecided func()
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
	return &Agent{cfg: cfg, opts: o, log: o.Logger, exhausted: map[string]bool{}}, nil
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
	tasks := []func(context.Context){a.batch.run, a.probeEtcd, a.maintain}
	if a.cfg.PeerRoutes {
		tasks = append(tasks, newPeerRouter(a).run)
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
	if err := a.readyErr(); err != nil {
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

// start does everything before serving: etcd, lease, node record,
// datapath, and the first attempt to restore blocks and endpoints. A
// failed restore does not stop the agent: it serves not-ready, saying
// why, and maintain retries.
func (a *Agent) start(ctx context.Context) error {
	a.bootID = readBootID()
	if err := a.openEtcd(ctx); err != nil {
		return err
	}
	a.store = etcdstore.New(a.cli, etcdstore.Options{ReservationTTL: a.cfg.ReservationTTL.Duration})
	var names []string
	for _, p := range a.cfg.Pools {
		if _, err := a.store.EnsurePool(ctx, p); err != nil {
			return fmt.Errorf("ensure pool %s: %w", p.Name, err)
		}
		names = append(names, p.Name)
	}
	var err error
	a.alloc, err = allocator.NewNodeAllocator(allocator.NodeConfig{
		Node: a.cfg.Node, BootID: a.bootID, Pools: names, Logger: a.log,
		Store: instrumentedStore{Store: a.store, m: a.metrics()},
	})
	if err != nil {
		return err
	}
	a.batch = newBatcher(a.alloc, a.cfg.MaxBatch, a.cfg.BatchWait.Duration, a.cfg.RequestTimeout.Duration, a.metrics())
	if err := a.openDatapath(); err != nil {
		return err
	}
	a.podMTU = a.detectMTU()
	if a.eps, err = openEndpointStore(filepath.Join(a.cfg.StateDir, "endpoints")); err != nil {
		a.log.Warn("some endpoint records could not be read", "error", err)
	}
	a.gc = newReconciler(a)
	sess, err := a.newSession(ctx)
	if err != nil {
		return err
	}
	a.setSession(sess)
	if err := a.restore(ctx, sess); err != nil {
		a.log.Error("restore failed; serving not-ready and retrying", "error", err)
		a.mu.Lock()
		a.restoreErr = err
		a.mu.Unlock()
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
	if err := a.drainDelQueue(ctx); err != nil {
		a.log.Warn("queued DELs left for a later pass", "error", err)
	}
	if err := a.restoreEndpoints(ctx); err != nil {
		return err
	}
	a.mu.Lock()
	a.restored, a.restoreErr = true, nil
	a.mu.Unlock()
	return nil
}

// maintain retries a failed restore until it succeeds, then runs the
// reconciler and keeps the lease, until ctx ends.
func (a *Agent) maintain(ctx context.Context) {
	b := backoff.NewExponentialBackOff()
	b.InitialInterval, b.MaxInterval, b.MaxElapsedTime = 200*time.Millisecond, 5*time.Second, 0
	for !a.isRestored() {
		select {
		case <-ctx.Done():
			return
		case <-time.After(b.NextBackOff()):
		}
		err := a.retryRestore(ctx)
		if err == nil {
			a.log.Info("restore succeeded; agent ready", "node", a.cfg.Node)
			break
		}
		a.log.Warn("restore failed again; still not ready", "error", err)
		a.mu.Lock()
		a.restoreErr = err
		a.mu.Unlock()
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); a.gc.run(ctx) }()
	a.keepLease(ctx)
	wg.Wait()
}

// retryRestore is one more restore attempt, on a new lease if the last
// one was lost meanwhile.
func (a *Agent) retryRestore(ctx context.Context) error {
	rctx, cancel := context.WithTimeout(ctx, a.cfg.RequestTimeout.Duration)
	defer cancel()
	sess := a.session()
	if sess == nil || sess.Lost() {
		ns, err := a.newSession(rctx)
		if err != nil {
			return err
		}
		if sess != nil {
			sess.Close()
		}
		a.setSession(ns)
		sess = ns
	}
	return a.restore(rctx, sess)
}

func (a *Agent) isRestored() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.restored
}

func (a *Agent) metrics() *metrics {
	if a.m == nil {
		a.m = newMetrics(func() []allocator.Usage {
			if a.alloc == nil {
				return nil
			}
			return a.alloc.Usage()
		})
	}
	return a.m
}

func (a *Agent) openEtcd(ctx context.Context) error {
	cfg := a.cfg.Etcd
	if len(cfg.Endpoints) == 0 {
		e, err := kvstore.StartEmbedded(ctx, kvstore.EmbedConfig{Dir: filepath.Join(a.cfg.StateDir, "etcd"), ClientURL: a.cfg.EmbeddedListen})
		if err != nil {
			return err
		}
		a.embedded = e
		cfg = e.Config()
		a.log.Info("started embedded etcd", "endpoints", cfg.Endpoints, "dir", filepath.Join(a.cfg.StateDir, "etcd"))
	}
	cli, err := kvstore.Connect(ctx, cfg)
	if err != nil {
		return err
	}
	a.cli = cli
	return nil
}

// newSession grants the node lease and writes the node record on it.
func (a *Agent) newSession(ctx context.Context) (*kvstore.Session, error) {
	ttl := int64(a.cfg.LeaseTTL.Seconds())
	sess, err := kvstore.NewSession(ctx, a.cli, ttl)
	if err != nil {
		return nil, err
	}
	if err := a.putNodeRecord(ctx, sess.ID()); err != nil {
		sess.Close()
		return nil, err
	}
	return sess, nil
}

// putNodeRecord writes the node record, with the endpoints found lost so
// far, on lease.
func (a *Agent) putNodeRecord(ctx context.Context, lease int64) error {
	a.mu.Lock()
	lost := slices.Clone(a.lost)
	a.mu.Unlock()
	rec := etcdstore.NodeRecord{Name: a.cfg.Node, BootID: a.bootID, Version: a.opts.Version, Addresses: a.nodeAddresses(),
		StartedAt: time.Now().UTC(), Lease: lease, LostEndpoints: lost}
	return a.store.PutNode(ctx, rec, lease)
}

func (a *Agent) setSession(s *kvstore.Session) {
	a.mu.Lock()
	a.sess = s
	a.mu.Unlock()
	held := 0.0
	if s != nil {
		held = 1
	}
	a.metrics().leaseHeld.Set(held)
}

func (a *Agent) session() *kvstore.Session {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.sess
}

func (a *Agent) openDatapath() error {
	mode := a.cfg.Datapath
	if mode == DatapathBPF || mode == DatapathAuto {
		dp, err := newBPFDatapath(a.cfg.BPFPinDir, a.cfg.NetNS, a.log)
		if err == nil {
			a.dp = dp
			return nil
		}
		if mode == DatapathBPF {
			return fmt.Errorf("datapath bpf: %w", err)
		}
		a.log.Warn("eBPF datapath unavailable, using routes mode", "reason", err)
	}
	dp, err := newRoutesDatapath(a.cfg.NetNS)
	if err != nil {
		return err
	}
	a.dp = dp
	return nil
}

// restoreEndpoints keeps every endpoint whose owner still holds its IPs
// and lets the datapath adopt them. Endpoints whose IPs are gone (released
// by an operator while the agent was down, maybe taken by another node
// since) are reported and torn down (checkEndpoints).
func (a *Agent) restoreEndpoints(ctx context.Context) error {
	keep := a.checkEndpoints(ctx, a.eps.list())
	if err := a.dp.Adopt(ctx, keep); err != nil {
		return fmt.Errorf("adopt endpoints: %w", err)
	}
	a.log.Info("restored endpoints", "count", len(keep))
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
	srv := &http.Server{Handler: a.routes(), ReadHeaderTimeout: 5 * time.Second, ErrorLog: a.log.StandardLogger(&hclog.StandardLoggerOptions{InferLevels: true})}
	return srv, ln, nil
}

func (a *Agent) serveMetrics() (*http.Server, error) {
	ln, err := net.Listen("tcp", a.cfg.MetricsAddr)
	if err != nil {
		return nil, fmt.Errorf("listen for metrics on %s: %w", a.cfg.MetricsAddr, err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(a.m.reg, promhttp.HandlerOpts{}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	return srv, nil
}

func (a *Agent) shutdown() {
	if s := a.session(); s != nil {
		s.Close() // no revoke: claims live out their TTL for a quick restart
	}
	if a.dp != nil {
		_ = a.dp.Close() // closes handles only: pinned eBPF keeps enforcing
	}
	if a.cli != nil {
		a.cli.Close()
	}
	if a.embedded != nil {
		a.embedded.Close()
	}
}

func readBootID() string {
	b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

func toOwner(o api.Owner) allocator.Owner {
	return allocator.Owner{ContainerID: o.ContainerID, IfName: o.IfName, Namespace: o.Namespace, Pod: o.Pod, Network: o.Network}
}

// ready reports whether the agent can allocate now, and why not.
func (a *Agent) readyErr() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	switch {
	case !a.restored && a.restoreErr != nil:
		return fmt.Errorf("restore failed, retrying: %w", a.restoreErr)
	case !a.restored:
		return errors.New("agent is restoring its state")
	case a.etcdErr != nil:
		return fmt.Errorf("etcd unreachable: %w", a.etcdErr)
	case a.sess == nil || a.sess.Lost():
		return errors.New("node lease lost; re-establishing")
	}
	return nil
}
