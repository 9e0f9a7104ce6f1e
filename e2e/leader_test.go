package e2e

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/invoke"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/e2e/cluster"
)

// TestClusterEtcdLeaderKilled runs a steady allocation load (the
// kvipam-ipam plugin, exec'd as a runtime does, ADD and DEL) on three
// nodes against a 3-member etcd cluster, and SIGKILLs the etcd leader.
// No node goes without a successful ADD for longer than the election took
// plus one second; every error the runtime sees is CNI code 11 (try
// again); nothing is duplicated or leaked; the killed member restarts and
// catches up.
func TestClusterEtcdLeaderKilled(t *testing.T) {
	ctx := context.Background()
	c := cluster.Start(t, cluster.Options{})
	var nodes []*node
	for i := range 3 {
		n := newNode(t, fmt.Sprintf("lk%d", i))
		// The call timeout matches the harness's election timeout (500 ms),
		// as docs/operations.md advises for any cluster.
		n.startAgent(agentOpts{pools: []string{"default=10.7.0.0/16"}, etcd: c,
			extra: []string{"--routing", "none", "--etcd-call-timeout", "500ms"}})
		nodes = append(nodes, n)
	}
	loads := make([]*ipamLoad, len(nodes))
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for i, n := range nodes {
		loads[i] = newIPAMLoad(t, n)
		wg.Add(1)
		go func() { defer wg.Done(); loads[i].run(stop) }()
	}
	defer func() {
		select {
		case <-stop:
		default:
			close(stop)
		}
		wg.Wait()
	}()
	for _, l := range loads {
		waitFor(t, 20*time.Second, "steady load on "+l.n.name, func() bool { return l.okCount() >= 20 })
	}

	leader, err := c.Leader(ctx)
	require.NoError(t, err)
	killed := time.Now()
	require.NoError(t, c.Kill(leader))
	wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	_, err = c.WaitLeader(wctx)
	require.NoError(t, err)
	election := time.Since(killed)
	// Load goes on for a while after the election.
	for _, l := range loads {
		after := time.Now()
		waitFor(t, 30*time.Second, "ADDs on "+l.n.name+" after the election", func() bool { return l.okSince(after) >= 20 })
	}
	close(stop)
	wg.Wait()

	for _, l := range loads {
		gap, p50, p99 := l.stats(killed)
		t.Logf("%s: election took %s; longest time without a successful ADD across the kill: %s; ADD p50 %s p99 %s; %d ADDs, errors %v",
			l.n.name, election.Round(time.Millisecond), gap.Round(time.Millisecond), p50.Round(time.Microsecond), p99.Round(time.Microsecond), l.okCount(), l.errorSummary())
		require.LessOrEqual(t, gap, election+time.Second, "%s: no ADD for longer than the election plus one second", l.n.name)
		for _, e := range l.errs {
			require.Equal(t, uint(types.ErrTryAgainLater), e.code, "%s: the runtime saw %s", l.n.name, e)
		}
	}

	// The killed member comes back and catches up.
	require.NoError(t, c.Restart(leader))
	cli := c.Client(t, cluster.RootUser)
	resp, err := cli.Get(ctx, etcdstore.AllIPsPrefix(), clientv3.WithPrefix())
	require.NoError(t, err)
	require.NoError(t, c.WaitRevision(wctx, leader, resp.Header.Revision))

	// Nothing duplicated or leaked: etcd holds exactly the addresses the
	// runtime holds, each once.
	held := map[string]string{} // ip -> container
	for _, l := range loads {
		l.finishDels(t)
		for id, ip := range l.held {
			require.NotContains(t, held, ip, "%s is held twice", ip)
			held[ip] = id
		}
	}
	resp, err = cli.Get(ctx, etcdstore.AllIPsPrefix(), clientv3.WithPrefix())
	require.NoError(t, err)
	inEtcd := map[string]string{}
	for _, kv := range resp.Kvs {
		al, err := etcdstore.DecodeAllocation("default", kv)
		require.NoError(t, err)
		require.NotContains(t, inEtcd, al.Addr.String())
		inEtcd[al.Addr.String()] = al.ContainerID
	}
	require.Equal(t, held, inEtcd, "etcd holds what the runtime holds")
	for _, l := range loads {
		l.delAll(t)
	}
	resp, err = cli.Get(ctx, etcdstore.AllIPsPrefix(), clientv3.WithPrefix(), clientv3.WithCountOnly())
	require.NoError(t, err)
	require.Zero(t, resp.Count, "every DEL released its address")
}

// ipamLoad is one node's runtime: it ADDs containers through the
// kvipam-ipam plugin, keeps a few, DELs the older ones, and records every
// result.
type ipamLoad struct {
	n    *node
	conf []byte
	seq  int

	mu    sync.Mutex
	oks   []time.Time     // successful ADDs, when they returned
	lat   []time.Duration // their latencies
	errs  []pluginErr
	held  map[string]string // container -> ip
	order []string          // held, oldest first
	toDel []string          // ADDs that failed, or DELs to retry
}

type pluginErr struct {
	op   string
	at   time.Time
	code uint
	msg  string
}

func (e pluginErr) String() string {
	return fmt.Sprintf("%s at %s: code %d: %s", e.op, e.at.Format("15:04:05.000"), e.code, e.msg)
}

func newIPAMLoad(t *testing.T, n *node) *ipamLoad {
	conf := fmt.Sprintf(`{"cniVersion":"1.0.0","name":"lk","type":"bridge","ipam":{"type":"kvipam-ipam","agentSocket":%q,"delQueueDir":%q,"agentTimeout":"5s"}}`,
		n.socket, filepath.Join(n.dir, "ipam-del-queue"))
	return &ipamLoad{n: n, conf: []byte(conf), held: map[string]string{}}
}

func (l *ipamLoad) exec(op, id string) (*current.Result, error) {
	args := &invoke.Args{Command: op, ContainerID: id, NetNS: l.n.host.Path(), IfName: "eth0", Path: l.n.bin}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	plugin := filepath.Join(l.n.bin, "kvipam-ipam")
	if op == "DEL" {
		return nil, invoke.ExecPluginWithoutResult(ctx, plugin, l.conf, args, nil)
	}
	r, err := invoke.ExecPluginWithResult(ctx, plugin, l.conf, args, nil)
	if err != nil {
		return nil, err
	}
	return current.NewResultFromResult(r)
}

func (l *ipamLoad) record(op string, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.errs = append(l.errs, pluginErr{op: op, at: time.Now(), msg: err.Error(), code: codeOf(err)})
}

// step is one ADD, and a DEL of the oldest once more than four are held,
// with failed ones retried first.
func (l *ipamLoad) step() {
	l.mu.Lock()
	retry := slices.Clone(l.toDel)
	l.mu.Unlock()
	for _, id := range retry {
		if err := l.del(id); err != nil {
			return
		}
	}
	l.seq++
	id := fmt.Sprintf("%s-%05d", l.n.name, l.seq)
	began := time.Now()
	r, err := l.exec("ADD", id)
	if err != nil {
		l.record("ADD "+id, err)
		l.mu.Lock()
		l.toDel = append(l.toDel, id) // as a runtime does: DEL what failed
		l.mu.Unlock()
		return
	}
	l.mu.Lock()
	l.oks = append(l.oks, time.Now())
	l.lat = append(l.lat, time.Since(began))
	l.held[id] = r.IPs[0].Address.IP.String()
	l.order = append(l.order, id)
	var oldest string
	if len(l.order) > 4 {
		oldest = l.order[0]
	}
	l.mu.Unlock()
	if oldest != "" {
		_ = l.del(oldest)
	}
}

// del DELs id; on failure it stays to be retried.
func (l *ipamLoad) del(id string) error {
	_, err := l.exec("DEL", id)
	if err != nil {
		l.record("DEL "+id, err)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if err != nil {
		if !slices.Contains(l.toDel, id) {
			l.toDel = append(l.toDel, id)
		}
		return err
	}
	l.toDel = slices.DeleteFunc(l.toDel, func(s string) bool { return s == id })
	delete(l.held, id)
	l.order = slices.DeleteFunc(l.order, func(s string) bool { return s == id })
	return nil
}

func codeOf(err error) uint {
	var te *types.Error
	if errors.As(err, &te) {
		return te.Code
	}
	return 999
}

func (l *ipamLoad) run(stop <-chan struct{}) {
	for {
		select {
		case <-stop:
			return
		default:
		}
		l.step()
	}
}

func (l *ipamLoad) okCount() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.oks)
}

func (l *ipamLoad) okSince(t time.Time) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, at := range l.oks {
		if at.After(t) {
			n++
		}
	}
	return n
}

// stats: the longest time without a successful ADD that spans at (the
// last success before it to the first after), and ADD latency p50, p99.
func (l *ipamLoad) stats(at time.Time) (gap, p50, p99 time.Duration) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for i := 1; i < len(l.oks); i++ {
		if !l.oks[i].Before(at) && l.oks[i-1].Before(at.Add(10*time.Second)) {
			from := l.oks[i-1]
			if from.Before(at.Add(-time.Second)) {
				from = at.Add(-time.Second)
			}
			gap = max(gap, l.oks[i].Sub(from))
		}
	}
	lat := slices.Clone(l.lat)
	slices.Sort(lat)
	return gap, lat[len(lat)/2], lat[len(lat)*99/100]
}

func (l *ipamLoad) errorSummary() map[string]int {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := map[string]int{}
	for _, e := range l.errs {
		out[fmt.Sprintf("code %d", e.code)]++
	}
	return out
}

// finishDels retries the DELs that failed until they succeed.
func (l *ipamLoad) finishDels(t *testing.T) {
	waitFor(t, 30*time.Second, "failed DELs on "+l.n.name+" to succeed", func() bool {
		l.mu.Lock()
		todo := slices.Clone(l.toDel)
		l.mu.Unlock()
		for _, id := range todo {
			if l.del(id) != nil {
				return false
			}
		}
		return true
	})
}

func (l *ipamLoad) delAll(t *testing.T) {
	for id := range maps.Clone(l.held) {
		require.NoError(t, l.del(id))
	}
}
