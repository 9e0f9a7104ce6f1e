package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/e2e/chaos"
	"github.com/kvipam/kvipam/e2e/cluster"
)

// TestChaosRun runs the chaos workload: a 3-member etcd cluster and
// CHAOS_NODES agents (default 4) as processes, pods added, checked and
// deleted through the real plugin at random, faults injected at random
// (seeded by CHAOS_SEED), for CHAOS_DURATION. The history checker then
// proves no address had two live owners, no answered ADD lost its
// allocation and nothing leaked. It runs only when CHAOS_DURATION is set
// (make chaos).
func TestChaosRun(t *testing.T) {
	dur, err := time.ParseDuration(os.Getenv("CHAOS_DURATION"))
	if err != nil || dur <= 0 {
		t.Skip("set CHAOS_DURATION (make chaos) to run the chaos workload")
	}
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("CHAOS_SEED"); s != "" {
		seed, err = strconv.ParseUint(s, 10, 64)
		require.NoError(t, err, "CHAOS_SEED")
	}
	nodes := 4
	if s := os.Getenv("CHAOS_NODES"); s != "" {
		nodes, err = strconv.Atoi(s)
		require.NoError(t, err, "CHAOS_NODES")
	}
	t.Logf("chaos: seed=%d duration=%s nodes=%d (replay with CHAOS_SEED=%d)", seed, dur, nodes, seed)
	rng := rand.New(rand.NewPCG(seed, 19))

	c := cluster.Start(t, cluster.Options{})
	rec := chaos.Record(context.Background(), c.Client(t, cluster.RootUser))
	r := newRouter(t)
	members := make([]*routedNode, nodes)
	for i := range members {
		members[i] = joinChaos(t, c, r, fmt.Sprintf("ch%d", i), 11+i)
	}

	w := &chaosWorkload{members: members, seed: seed, until: time.Now().Add(dur)}
	var wg sync.WaitGroup
	for i := range 2 * nodes {
		wg.Go(func() { w.worker(i) })
	}
	f := &chaosFaults{t: t, c: c, members: members, rng: rng}
	for time.Now().Before(w.until) {
		time.Sleep(time.Duration(2000+rng.IntN(4000)) * time.Millisecond) // pacing, not synchronisation
		if time.Now().After(w.until) {
			break
		}
		f.inject()
	}
	wg.Wait()
	f.heal()
	end := time.Now()

	// Past the reservation TTL (10s) and the GC grace (0s), nothing an
	// unfinished ADD reserved may be left.
	time.Sleep(12 * time.Second)
	changes, werr := rec.Stop()
	require.NoError(t, werr, "the recorder saw the whole history")
	cli := c.Client(t, cluster.RootUser)
	resp, err := cli.Get(context.Background(), etcdstore.AllIPsPrefix(), clientv3.WithPrefix())
	require.NoError(t, err)
	final := map[netip.Addr]string{}
	for _, kv := range resp.Kvs {
		pool, _, _ := strings.Cut(strings.TrimPrefix(string(kv.Key), etcdstore.AllIPsPrefix()), "/")
		if al, err := etcdstore.DecodeAllocation(pool, kv); err == nil && al.ContainerID != "" {
			final[al.Addr] = al.Owner.Key()
		}
	}
	ops := w.history()
	findings := chaos.Check(ops, changes, final, end)
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
	t.Logf("chaos: faults by kind %v; operations %d (%d failed, as expected under faults); %d borrowed and %d sticky-kept writes",
		f.byKind, len(ops), w.failed.Load(), borrowed, kept)
	t.Logf("chaos: seed=%d ops=%d faults=%d duplicates=%d lost=%d leaks=%d", seed, len(ops), f.total, counts["duplicate"], counts["lost"], counts["leak"])
	if t.Failed() {
		keepHistory(t, seed, ops, changes)
	}
	fc, err := c.ClientConfig(cluster.RootUser)
	require.NoError(t, err)
	out, err := exec.Command(filepath.Join(members[0].n.bin, "kvipamctl"), "check", "--endpoints", strings.Join(c.Endpoints(), ","),
		"--cacert", fc.CAFile, "--cert", fc.CertFile, "--key", fc.KeyFile).CombinedOutput()
	require.NoError(t, err, "kvipamctl check after the run:\n%s", out)
}

func joinChaos(t *testing.T, c *cluster.Cluster, r *router, name string, host int) *routedNode {
	n := newNode(t, name)
	addr := r.attach(t, n, "A", host)
	// 14 addresses in blocks of 4: nodes borrow across blocks.
	n.startAgent(agentOpts{pools: []string{"chaos=10.12.0.0/28"}, blockV4: 30, etcd: c, reservationTTL: 10 * time.Second,
		extra: []string{"--node-address", addr.String(), "--lease-ttl", "5s", "--reuse-cooldown", "0s"}})
	return &routedNode{n: n, addr: addr, l: n.kvipamList("kv", "1.0.0", `,"capabilities":{"io.kubernetes.cri.pod-annotations":true}`)}
}

// chaosWorkload adds, checks and deletes pods at random.
type chaosWorkload struct {
	members []*routedNode
	seed    uint64
	until   time.Time
	failed  atomic.Int64
	mu      sync.Mutex
	ops     []chaos.Op
}

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
	for gen := 0; time.Now().Before(w.until); gen++ {
		m := w.members[rng.IntN(len(w.members))]
		p := newPod(m.n.t, fmt.Sprintf("w%d-%d", id, gen))
		var identity string
		if rng.IntN(4) == 0 { // a sticky StatefulSet pod, re-created on any node
			name := fmt.Sprintf("sts-%d", id)
			identity = "e2e/" + name
			p.rt.Args = [][2]string{{"IgnoreUnknown", "1"}, {"K8S_POD_NAMESPACE", "e2e"}, {"K8S_POD_NAME", name}, {"K8S_POD_UID", podUID(p.name)}}
			p.rt.CapabilityArgs = map[string]any{"io.kubernetes.cri.pod-annotations": map[string]string{"kvipam.io/sticky": "1m"}}
		}
		owner := p.rt.ContainerID + "/" + p.rt.IfName
		start := time.Now()
		res, err := m.n.add(m.l, p)
		op := chaos.Op{Kind: "add", Owner: owner, Identity: identity, Window: time.Minute, Node: m.n.name, Start: start, End: time.Now()}
		if err != nil {
			op.Err = err.Error()
		} else {
			v4, _ := podAddrs(m.n.t, res)
			op.Addrs = []netip.Addr{v4}
		}
		w.record(op)
		if err == nil {
			time.Sleep(time.Duration(200+rng.IntN(3000)) * time.Millisecond) // the pod's life
			if time.Now().After(w.until) {
				return // live at the end: it must still hold its address
			}
			_ = m.n.check(m.l, p)
		}
		// DEL, also after a failed ADD, as a runtime does; retried until it
		// succeeds (a DEL with the agent down is queued and succeeds).
		for {
			start := time.Now()
			err := m.n.del(m.l, p)
			op := chaos.Op{Kind: "del", Owner: owner, Node: m.n.name, Start: start, End: time.Now()}
			if err != nil {
				op.Err = err.Error()
			}
			w.record(op)
			if err == nil {
				break
			}
			time.Sleep(500 * time.Millisecond)
		}
	}
}

// chaosFaults injects faults at random, each logged with its time.
type chaosFaults struct {
	t       *testing.T
	c       *cluster.Cluster
	members []*routedNode
	rng     *rand.Rand
	total   int
	byKind  map[string]int
}

func (f *chaosFaults) log(kind, format string, args ...any) {
	if f.byKind == nil {
		f.byKind = map[string]int{}
	}
	f.byKind[kind]++
	f.total++
	f.t.Logf("fault %s at %s: %s", kind, time.Now().UTC().Format("15:04:05.000"), fmt.Sprintf(format, args...))
}

func (f *chaosFaults) inject() {
	m := f.members[f.rng.IntN(len(f.members))]
	switch k := f.rng.IntN(5); k {
	case 0:
		f.log("agent-kill", "SIGKILL agent %s", m.n.name)
		m.n.killAgent()
		m.n.startAgent(m.n.agentArgs)
	case 1:
		f.log("agent-pause", "SIGSTOP agent %s for 7s (lease TTL 5s), then SIGCONT", m.n.name)
		_ = m.n.agent.Process.Signal(syscall.SIGSTOP)
		time.Sleep(7 * time.Second)
		_ = m.n.agent.Process.Signal(syscall.SIGCONT)
	case 2:
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		i, err := f.c.Leader(ctx)
		cancel()
		if err != nil || f.rng.IntN(2) == 0 {
			i = f.rng.IntN(f.c.Len())
		}
		f.log("etcd-kill", "SIGKILL etcd member %d, restart after 2s", i)
		_ = f.c.Kill(i)
		time.Sleep(2 * time.Second)
		require.NoError(f.t, f.c.Restart(i))
	case 3:
		f.log("power-cut", "SIGKILL every agent, then start them all")
		for _, x := range f.members {
			x.n.killAgent()
		}
		for _, x := range f.members {
			x.n.startAgent(x.n.agentArgs)
		}
	case 4:
		f.log("agent-restart", "SIGTERM agent %s and start it again", m.n.name)
		m.n.restartAgent()
	}
}

// heal makes sure every member and agent runs again.
func (f *chaosFaults) heal() {
	for i := range f.c.Len() {
		if !f.c.Running(i) {
			require.NoError(f.t, f.c.Restart(i))
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(f.t, f.c.WaitHealthy(ctx))
	for _, m := range f.members {
		if m.n.agent == nil {
			m.n.startAgent(m.n.agentArgs)
		}
	}
}

// keepHistory writes a failing run's history beside its seed, for replay.
func keepHistory(t *testing.T, seed uint64, ops []chaos.Op, changes []chaos.Change) {
	dir := filepath.Join(os.TempDir(), fmt.Sprintf("kvipam-chaos-%d", seed))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return
	}
	b, _ := json.MarshalIndent(map[string]any{"seed": seed, "ops": ops, "changes": changes}, "", " ")
	_ = os.WriteFile(filepath.Join(dir, "history.json"), b, 0o644)
	t.Logf("chaos: history kept in %s", dir)
}
