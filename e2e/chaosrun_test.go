package e2e

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/kvipam/kvipam/e2e/chaos"
	"github.com/kvipam/kvipam/e2e/cluster"
	"github.com/kvipam/kvipam/internal/testsupport/cutproxy"
	"github.com/kvipam/kvipam/internal/testsupport/nstest"
)

// TestChaosRun runs the chaos workload: a 3-member etcd cluster and
// CHAOS_NODES agents (default 4) as processes, pods added, checked and
// deleted through the real plugin at random, faults injected at random
// (seeded by CHAOS_SEED), for CHAOS_DURATION. The history checker then
// proves no address had two live owners, no answered ADD lost its
// allocation and nothing leaked. It runs only when CHAOS_DURATION is set
// (make chaos). CHAOS_MIXED=v0.1.0 makes it a mixed-version run
// (chaosversions_test.go): each node starts on that release or on HEAD,
// and nodes are upgraded and rolled back during the run.
func TestChaosRun(t *testing.T) {
	dur, err := time.ParseDuration(os.Getenv("CHAOS_DURATION"))
	if err != nil || dur <= 0 {
		t.Skip("set CHAOS_DURATION (make chaos) to run the chaos workload")
	}
	cfg := chaosConfig{seed: chaosSeed(t), duration: dur, nodes: 4, routing: chaosRouting(t), mixed: os.Getenv("CHAOS_MIXED")}
	if s := os.Getenv("CHAOS_NODES"); s != "" {
		cfg.nodes, err = strconv.Atoi(s)
		require.NoError(t, err, "CHAOS_NODES")
	}
	runChaos(t, cfg)
}

// chaosSeed is CHAOS_SEED, or a new seed.
func chaosSeed(t *testing.T) uint64 {
	s := os.Getenv("CHAOS_SEED")
	if s == "" {
		return uint64(time.Now().UnixNano())
	}
	seed, err := strconv.ParseUint(s, 10, 64)
	require.NoError(t, err, "CHAOS_SEED")
	return seed
}

// chaosConfig is one chaos run's shape.
type chaosConfig struct {
	seed     uint64
	duration time.Duration
	nodes    int
	// routing is "" (routes) or "bgp" (CHAOS_ROUTING).
	routing string
	// mixed, if set, is the release (v0.1.0) the nodes run beside HEAD:
	// a mixed-version run.
	mixed string
}

// runChaos runs one chaos workload and checks its whole history.
func runChaos(t *testing.T, cfg chaosConfig) {
	seed, dur, nodes, routing := cfg.seed, cfg.duration, cfg.nodes, cfg.routing
	t.Logf("chaos: seed=%d duration=%s nodes=%d routing=%q mixed=%q (replay with CHAOS_SEED=%d)", seed, dur, nodes, routing, cfg.mixed, seed)
	rng := rand.New(rand.NewPCG(seed, 19))

	head := bins(t)
	var v *chaosVersions
	starts := slices.Repeat([]chaosBuild{{version: headVersion, dir: head}}, nodes)
	if cfg.mixed != "" {
		v = newChaosVersions(t, cfg.mixed, head, rng, nodes)
		starts = v.startBuilds(nodes)
	}
	c := cluster.Start(t, cluster.Options{})
	rec := chaos.Record(context.Background(), c.Client(t, cluster.RootUser))
	ctl := clusterCtl(t, c, head) // HEAD's kvipamctl, the operator's
	r := newRouter(t)
	var fabric *chaosBGP
	if routing == "bgp" {
		fabric = startChaosBGP(t, r, nodes)
	}
	members := make([]*chaosNode, nodes)
	for _, i := range joinOrder(starts) {
		members[i] = joinChaos(t, c, r, fmt.Sprintf("ch%d", i), 11+i, fabric, starts[i])
	}
	if fabric != nil {
		fabric.start(t, members)
	}

	f := &chaosFaults{t: t, c: c, members: members, rng: rng, cli: c.Client(t, cluster.RootUser)}
	w := &chaosWorkload{t: t, members: members, seed: seed, faults: f}
	w.extend(time.Now().Add(dur))
	var wg sync.WaitGroup
	for i := range 2 * nodes {
		wg.Go(func() { w.worker(i) })
	}
	var vms *chaosVMs
	if cfg.mixed == "" && nodes >= 2 {
		vms = &chaosVMs{w: w, c: c, ctl: head}
		for i := range chaosVMCount {
			wg.Go(func() { vms.run(i) })
		}
	}
	// A run that ends early (a failed require) stops its workers before
	// the cleanups run, so that they make no namespace after them.
	defer func() { w.stopped.Store(true); wg.Wait() }()
	// Every kind once, in order (the run lasts until they have fired,
	// the workload going on), then at random.
	kinds, ordered := faultKinds, faultKinds
	if vms != nil {
		kinds = append(slices.Clone(faultKinds), migrationFaultKinds...)
		ordered = kinds
	}
	planned := kinds // each fires at least once in a long run
	if v != nil {
		v.begin(members, c.Client(t, cluster.RootUser), ctl)
		kinds, ordered = append(slices.Clone(faultKinds), versionSteps...), v.plan(faultKinds)
	}
	for k := 0; k < len(ordered) || time.Now().Before(w.deadline()); k++ {
		time.Sleep(time.Duration(2000+rng.IntN(3000)) * time.Millisecond) // pacing, not synchronisation
		var kind string
		switch {
		case k < len(ordered):
			kind = ordered[k]
			w.extend(time.Now().Add(30 * time.Second))
		case time.Now().After(w.deadline()):
			continue // past the deadline: the loop's condition ends it
		default:
			kind = kinds[rng.IntN(len(kinds))]
		}
		if slices.Contains(versionSteps, kind) {
			v.step(kind)
		} else {
			f.inject(kind)
		}
	}
	wg.Wait()
	f.heal()
	end := time.Now()

	// Past the reservation TTL (10s) and the GC grace (0s), nothing an
	// unfinished ADD reserved may be left.
	time.Sleep(12 * time.Second)
	changes, werr := rec.Stop()
	require.NoError(t, werr, "the recorder saw the whole history")
	final := chaosFinal(t, c.Client(t, cluster.RootUser))
	ops := w.history()
	findings := chaos.Check(ops, changes, final.Owners(), end)
	findings = append(findings, chaos.Migrations(ops, changes, rec.Bindings(), final, end)...)
	findings = append(findings, chaos.Placement(changes, rec.Homes())...)
	ivs := ipHistory(t, ctl, netip.MustParsePrefix("10.12.0.0/28"))
	findings = append(findings, chaos.History(ops, ivs, end)...)
	var bgpFigures string
	if fabric != nil {
		var fds []chaos.Finding
		fds, bgpFigures = fabric.check(t, rec.Backing(), members)
		findings = append(findings, fds...)
	}
	counts := map[string]int{}
	for _, fd := range findings {
		counts[fd.Kind]++
		t.Errorf("%s", fd)
	}
	borrowed, kept := 0, 0
	for _, ch := range changes {
		if ch.Borrowed && ch.State == "allocated" {
			borrowed++
		}
		if ch.State == "kept" {
			kept++
		}
	}
	t.Logf("chaos: faults skipped (could not be injected when due) by kind %v", f.skipped)
	t.Logf("chaos: faults by kind %v; recoveries %d (agents ready again, etcd healthy again); operations %d (%d failed, as expected under faults); %d borrowed and %d sticky-kept writes; %d IP history intervals agree",
		f.byKind, f.recoveries, len(ops), w.failed.Load(), borrowed, kept, len(ivs))
	if dur >= 2*time.Minute {
		for _, k := range planned {
			if f.byKind[k] == 0 {
				t.Errorf("fault kind %s never fired", k)
			}
		}
	}
	if v != nil {
		v.report() // every step kind fired: the ordered plan has them all
	}
	if out, err := ctl("check"); err != nil {
		t.Errorf("kvipamctl check after the run: %v\n%s", err, out)
	}
	if t.Failed() {
		keepHistory(t, seed, ops, changes, rec.Bindings(), members)
	}
	if fds, err := os.ReadDir("/proc/self/fd"); err == nil {
		t.Logf("chaos: %d file descriptors open at the end (pods release their namespaces)", len(fds))
	}
	skipped := 0
	for _, n := range f.skipped {
		skipped += n
	}
	summary := fmt.Sprintf("chaos: seed=%d ops=%d faults=%d skipped=%d duplicates=%d lost=%d leaks=%d", seed, len(ops), f.total, skipped, counts["duplicate"], counts["lost"], counts["leak"])
	if v != nil {
		summary += " " + v.figures()
	}
	if vms != nil {
		summary += fmt.Sprintf(" forwarding=%d owner=%d %s", counts["forwarding"], counts["owner"], vms.figures(rec.Bindings()))
	}
	if bgpFigures != "" {
		summary += " " + bgpFigures
	}
	t.Logf("%s", summary)
}

// chaosNode is a chaos run's node: its agent reaches etcd through
// proxies the run can cut, and its state directory is a small tmpfs the
// run can make read-only.
type chaosNode struct {
	routedNode
	proxies []*cutproxy.Proxy
	state   string
	// bins is the node's own directory of kvipam's binaries, and version
	// the build they are (headVersion, or a release's): a mixed run
	// upgrades and rolls the node back by switching them.
	bins    *nodeBins
	version string
}

// joinChaos starts node name at .host of subnet A, on the binaries of
// build (a build's name and its bin directory); with a BGP fabric its
// agent runs in the node's namespace, its proxies listen there, and it
// announces to the fabric's router.
func joinChaos(t *testing.T, c *cluster.Cluster, r *router, name string, host int, fabric *chaosBGP, build chaosBuild) *chaosNode {
	n := newNode(t, name)
	addr := r.attach(t, n, "A", host)
	cn := &chaosNode{state: filepath.Join(n.dir, "state"), version: build.version}
	cn.bins = newNodeBins(t, filepath.Join(n.dir, "bin"), build.dir)
	n.useBins(cn.bins.dir)
	var endpoints []string
	for _, ep := range c.Endpoints() {
		u, err := url.Parse(ep)
		require.NoError(t, err)
		var ln net.Listener
		listen := func() (err error) { ln, err = net.Listen("tcp", "127.0.0.1:0"); return err }
		if fabric != nil {
			require.NoError(t, n.do(listen)) // a socket keeps the namespace it was made in
		} else {
			require.NoError(t, listen())
		}
		p := cutproxy.Serve(ln, u.Host)
		t.Cleanup(p.Close)
		cn.proxies = append(cn.proxies, p)
		endpoints = append(endpoints, u.Scheme+"://"+p.Addr())
	}
	require.NoError(t, os.MkdirAll(cn.state, 0o700))
	require.NoError(t, unix.Mount("tmpfs", cn.state, "tmpfs", 0, "size=16m"))
	t.Cleanup(func() { _ = unix.Unmount(cn.state, unix.MNT_DETACH) })
	// 14 addresses in blocks of 4: nodes borrow across blocks.
	opts := agentOpts{pools: []string{"chaos=10.12.0.0/28"}, blockV4: 30, etcd: c, etcdEndpoints: endpoints, reservationTTL: 10 * time.Second, reuseAtOnce: true,
		extra: []string{"--node-address", addr.String(), "--lease-ttl", chaosLeaseTTL.String()}}
	if fabric != nil {
		opts.inNode = true
		opts.extra = append(opts.extra, "--routing", "bgp")
		opts.bgp = fabric.agentBGP(n, addr)
	}
	n.startAgent(opts)
	cn.routedNode = routedNode{n: n, addr: addr, l: n.kvipamList("kv", "1.0.0", `,"capabilities":{"io.kubernetes.cri.pod-annotations":true}`)}
	return cn
}

// chaosWorkload adds, checks and deletes pods at random.
type chaosWorkload struct {
	t       *testing.T
	members []*chaosNode
	faults  *chaosFaults
	seed    uint64
	// until is when the workers stop starting pods (unix nanoseconds):
	// extend, deadline.
	until  atomic.Int64
	failed atomic.Int64
	// stopped ends the workers early: the run failed.
	stopped atomic.Bool
	mu      sync.Mutex
	ops     []chaos.Op
}

// extend makes the run last until t at least.
func (w *chaosWorkload) extend(t time.Time) {
	for {
		old := w.until.Load()
		if old >= t.UnixNano() || w.until.CompareAndSwap(old, t.UnixNano()) {
			return
		}
	}
}

// deadline is when the workers stop.
func (w *chaosWorkload) deadline() time.Time { return time.Unix(0, w.until.Load()) }

func (w *chaosWorkload) record(op chaos.Op) {
	w.mu.Lock()
	w.ops = append(w.ops, op)
	w.mu.Unlock()
	if op.Err != "" {
		w.failed.Add(1)
	}
}

func (w *chaosWorkload) history() []chaos.Op {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]chaos.Op(nil), w.ops...)
}

func (w *chaosWorkload) worker(id int) {
	rng := rand.New(rand.NewPCG(w.seed, uint64(id)+100))
	for gen := 0; time.Now().Before(w.deadline()) && !w.stopped.Load(); gen++ {
		m := w.members[rng.IntN(len(w.members))]
		p, release, err := newEphemeralPod(w.t, fmt.Sprintf("w%d-%d", id, gen))
		if err != nil {
			m.n.t.Errorf("worker %d: %v", id, err)
			return
		}
		var identity string
		if rng.IntN(4) == 0 { // a sticky StatefulSet pod, re-created on any node
			name := fmt.Sprintf("sts-%d", id)
			identity = "e2e/" + name
			p.rt.Args = [][2]string{{"IgnoreUnknown", "1"}, {"K8S_POD_NAMESPACE", "e2e"}, {"K8S_POD_NAME", name}, {"K8S_POD_UID", podUID(p.name)}}
			p.rt.CapabilityArgs = map[string]any{"io.kubernetes.cri.pod-annotations": map[string]string{"kvipam.io/sticky": "1m"}}
		}
		if _, ok := w.add(m, p, chaos.Op{Identity: identity, Window: time.Minute}); ok {
			time.Sleep(time.Duration(200+rng.IntN(3000)) * time.Millisecond) // the pod's life
			if time.Now().After(w.deadline()) {
				return // live at the end: it must still hold its address (released at cleanup)
			}
			_ = m.n.check(m.l, p)
		}
		// DEL, also after a failed ADD, as a runtime does.
		w.del(m, p)
		release()
	}
}

// add is p's ADD on m, recorded as op (its identity, window and
// migration set by the caller): the address it answered, and whether it
// succeeded.
func (w *chaosWorkload) add(m *chaosNode, p *pod, op chaos.Op) (netip.Addr, bool) {
	op.Kind, op.Owner, op.Node = "add", p.rt.ContainerID+"/"+p.rt.IfName, m.n.name
	ctx, cancel := w.faults.pluginContext("ADD of " + op.Owner + " on " + m.n.name)
	op.Start = time.Now()
	res, err := m.n.addCtx(ctx, m.l, p)
	cancel()
	op.End = time.Now()
	var v4 netip.Addr
	if err != nil {
		op.Err = err.Error()
	} else {
		v4, _ = podAddrs(m.n.t, res)
		op.Addrs = []netip.Addr{v4}
	}
	w.record(op)
	return v4, err == nil
}

// del is p's DEL on m, as a runtime sends it: retried until it succeeds
// (a DEL with the agent down is queued and succeeds), each try recorded.
func (w *chaosWorkload) del(m *chaosNode, p *pod) {
	owner := p.rt.ContainerID + "/" + p.rt.IfName
	for {
		ctx, cancel := w.faults.pluginContext("DEL of " + owner + " on " + m.n.name)
		start := time.Now()
		err := m.n.delCtx(ctx, m.l, p)
		cancel()
		op := chaos.Op{Kind: "del", Owner: owner, Node: m.n.name, Start: start, End: time.Now()}
		if err != nil {
			op.Err = err.Error()
		}
		w.record(op)
		if err == nil || w.stopped.Load() {
			return
		}
		time.Sleep(500 * time.Millisecond)
	}
}

// newEphemeralPod is newPod for the chaos workload, whose thousands of
// pods each release their namespace after their DEL. The release is also
// registered as t's cleanup at creation, so a run that fails, or a pod
// live at the end, leaves no namespace behind (release is idempotent).
func newEphemeralPod(t *testing.T, name string) (*pod, func(), error) {
	n, release, err := nstest.NewEphemeralNS()
	if err != nil {
		return nil, nil, err
	}
	t.Cleanup(release)
	return podIn(name, n), release, nil
}
