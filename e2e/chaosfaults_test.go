package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	"golang.org/x/sys/unix"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/e2e/cluster"
	"github.com/kvipam/kvipam/internal/testsupport/cutproxy"
)

// The fault kinds, each fired at least once (in this order) by a run.
var faultKinds = []string{"agent-kill", "agent-kill-mid-add", "agent-pause", "etcd-kill", "etcd-cut", "state-readonly", "plugin-kill", "power-cut", "agent-restart"}

// chaosFaults injects faults at random, each logged with its time.
type chaosFaults struct {
	t       *testing.T
	c       *cluster.Cluster
	cli     *clientv3.Client
	members []*chaosNode
	rng     *rand.Rand
	mu      sync.Mutex
	total   int
	byKind  map[string]int
	// skipped counts, by kind, faults the run could not inject when their
	// turn came (logged with why); the run goes on without them.
	skipped map[string]int
	// recoveries counts agents started again and ready, and etcd members
	// restarted.
	recoveries int
	// killPlugin makes the next plugin call be killed a few milliseconds in.
	killPlugin atomic.Bool
}

func (f *chaosFaults) log(kind, format string, args ...any) {
	f.mu.Lock()
	if f.byKind == nil {
		f.byKind = map[string]int{}
	}
	f.byKind[kind]++
	f.total++
	f.mu.Unlock()
	f.t.Logf("fault %s at %s: %s", kind, time.Now().UTC().Format("15:04:05.000"), fmt.Sprintf(format, args...))
}

// skip logs a fault that cannot be injected right now (the harness's
// limit, not the system's): it is counted as skipped, and the run goes on.
func (f *chaosFaults) skip(kind, format string, args ...any) {
	f.mu.Lock()
	if f.skipped == nil {
		f.skipped = map[string]int{}
	}
	f.skipped[kind]++
	f.mu.Unlock()
	f.t.Logf("fault %s at %s skipped: %s", kind, time.Now().UTC().Format("15:04:05.000"), fmt.Sprintf(format, args...))
}

// pluginContext is the context of one plugin call: a few milliseconds
// long when a plugin-kill fault is due, so libcni kills the plugin midway.
func (f *chaosFaults) pluginContext(what string) (context.Context, context.CancelFunc) {
	if !f.killPlugin.CompareAndSwap(true, false) {
		return context.WithCancel(context.Background())
	}
	d := time.Duration(2+rand.IntN(40)) * time.Millisecond
	f.log("plugin-kill", "the plugin of the %s is killed after %s", what, d)
	return context.WithTimeout(context.Background(), d)
}

func (f *chaosFaults) inject(kind string) {
	m := f.members[f.rng.IntN(len(f.members))]
	switch kind {
	case "agent-kill":
		f.log(kind, "SIGKILL agent %s", m.n.name)
		m.n.killAgent()
		m.n.startAgent(m.n.agentArgs)
		f.recoveries++
	case "agent-kill-mid-add":
		f.killMidAdd()
	case "agent-kill-mid-migration", "etcd-cut-mid-migration":
		f.midMigration(kind)
	case "agent-pause":
		f.log(kind, "SIGSTOP agent %s for 7s (lease TTL 5s), then SIGCONT", m.n.name)
		_ = m.n.agent.Process.Signal(syscall.SIGSTOP)
		time.Sleep(7 * time.Second)
		_ = m.n.agent.Process.Signal(syscall.SIGCONT)
	case "etcd-kill":
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		i, err := f.c.Leader(ctx)
		cancel()
		if err != nil || f.rng.IntN(2) == 0 {
			i = f.rng.IntN(f.c.Len())
		}
		if !f.c.Running(i) {
			f.skip(kind, "etcd member %d is not running (its last restart failed)", i)
			return
		}
		f.log(kind, "SIGKILL etcd member %d (leader: %v), restart after 2s", i, err == nil)
		_ = f.c.Kill(i)
		time.Sleep(2 * time.Second)
		if err := retryBusy(func() error { return f.c.Restart(i) }); err != nil {
			// heal starts it at the end; meanwhile two members keep quorum
			// and the next etcd-kill of this member is skipped.
			f.t.Logf("fault %s: etcd member %d did not restart, left for the end of the run: %v", kind, i, err)
			return
		}
		f.recoveries++
	case "etcd-cut":
		// Mostly a silent partition (packets dropped: requests and
		// keepalives hang), sometimes a loud one (connections reset).
		how, cut := "packets dropped, connections hang", (*cutproxy.Proxy).Stall
		if f.rng.IntN(3) == 0 {
			how, cut = "connections reset and refused", (*cutproxy.Proxy).Cut
		}
		f.log(kind, "agent %s cut off from etcd for 8s (lease TTL 5s; %s), then healed", m.n.name, how)
		for _, p := range m.proxies {
			cut(p)
		}
		time.Sleep(8 * time.Second)
		for _, p := range m.proxies {
			p.Heal()
		}
	case "state-readonly":
		// The remount fails with EBUSY while the agent has a file open for
		// writing (an endpoint record being written): tried again a few
		// times, then skipped.
		if err := retryBusy(func() error { return unix.Mount("", m.state, "", unix.MS_REMOUNT|unix.MS_RDONLY, "") }); err != nil {
			f.skip(kind, "agent %s's state directory cannot be made read-only now: %v", m.n.name, err)
			return
		}
		f.log(kind, "agent %s's state directory read-only for 5s", m.n.name)
		time.Sleep(5 * time.Second)
		if err := retryBusy(func() error { return unix.Mount("", m.state, "", unix.MS_REMOUNT, "size=16m") }); err != nil {
			f.t.Errorf("fault %s: agent %s's state directory stays read-only: %v", kind, m.n.name, err) // heal tries again
		}
	case "plugin-kill":
		f.killPlugin.Store(true) // the next ADD or DEL logs it
	case "power-cut":
		f.log(kind, "SIGKILL every agent, then start them all")
		for _, x := range f.members {
			x.n.killAgent()
		}
		for _, x := range f.members {
			x.n.startAgent(x.n.agentArgs)
			f.recoveries++
		}
	case "agent-restart":
		f.log(kind, "SIGTERM agent %s and start it again", m.n.name)
		m.n.restartAgent()
		f.recoveries++
	}
}

// retryBusy calls op until it succeeds, up to ten times 300 ms apart:
// a remount or a restart may fail for a moment (EBUSY, a port not yet
// free) and succeed soon after.
func retryBusy(op func() error) error {
	var err error
	for range 10 {
		if err = op(); err == nil {
			return nil
		}
		time.Sleep(300 * time.Millisecond)
	}
	return err
}

// killMidAdd waits for a reservation (an ADD between its allocate and
// its endpoint) and kills that node's agent at once; with no ADD in
// flight for 20 s it is skipped.
func (f *chaosFaults) killMidAdd() {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	defer func() {
		if errors.Is(ctx.Err(), context.DeadlineExceeded) {
			f.skip("agent-kill-mid-add", "no reservation written in 20s")
		}
	}()
	for resp := range f.cli.Watch(ctx, etcdstore.AllIPsPrefix(), clientv3.WithPrefix()) {
		for _, ev := range resp.Events {
			if ev.Type != clientv3.EventTypePut || ev.Kv.Lease == 0 {
				continue
			}
			var rec struct {
				Node  string `json:"node"`
				State string `json:"state"`
			}
			if json.Unmarshal(ev.Kv.Value, &rec) != nil || rec.State != "reserved" {
				continue
			}
			for _, m := range f.members {
				if m.n.name == rec.Node {
					f.log("agent-kill-mid-add", "SIGKILL agent %s right after its reservation %s", m.n.name, ev.Kv.Key)
					m.n.killAgent()
					m.n.startAgent(m.n.agentArgs)
					f.recoveries++
					return
				}
			}
		}
	}
}

// heal makes sure every member, proxy and agent runs again.
func (f *chaosFaults) heal() {
	for _, m := range f.members {
		for _, p := range m.proxies {
			p.Heal()
		}
		_ = unix.Mount("", m.state, "", unix.MS_REMOUNT, "size=16m")
	}
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
