package nodealloc_test

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/e2e/cluster"
	"github.com/kvipam/kvipam/internal/foundation/retry"
	"github.com/kvipam/kvipam/internal/testsupport/agenttest"
	"github.com/kvipam/kvipam/kvstore"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// The etcds a fleet runs on (KVIPAM_SCALE_ETCD, a comma-separated list;
// each is a sub-benchmark etcd=<name>):
const (
	// etcdEmbed is one member in the test's process (kvstore/etcdtest):
	// no TLS, no replication.
	etcdEmbed = "embed"
	// etcdCluster3 is three member processes on loopback with mutual TLS
	// (e2e/cluster): every write is replicated to a quorum, as in a
	// cluster. The default. Their gRPC goes through Go's HTTP/2 handler
	// on the port their HTTP endpoints share, as in kubeadm's etcd.
	etcdCluster3 = "cluster3"
	// etcdCluster3OwnHTTP is the same with the HTTP endpoints on a
	// listener of their own (cluster.Options.OwnHTTPListener), so that
	// grpc-go serves the client URL itself, as etcd advises for
	// production.
	etcdCluster3OwnHTTP = "cluster3-ownhttp"
	// etcdCluster3Auth is cluster3 with authentication on, the nodes'
	// user holding a role (not root) on every key, as operations.md has
	// kvipam's user hold one on its prefix: etcd then checks the user's
	// permission for every compare and operation of a transaction.
	etcdCluster3Auth = "cluster3-auth"
)

// scaleBackends are the etcds KVIPAM_SCALE_ETCD names (default cluster3).
func scaleBackends(b *testing.B) []string {
	var out []string
	for _, s := range strings.Split(cmp.Or(os.Getenv("KVIPAM_SCALE_ETCD"), etcdCluster3), ",") {
		switch s = strings.TrimSpace(s); s {
		case etcdEmbed, etcdCluster3, etcdCluster3OwnHTTP, etcdCluster3Auth:
			out = append(out, s)
		default:
			b.Fatalf("KVIPAM_SCALE_ETCD: %q is none of %s, %s, %s and %s", s, etcdEmbed, etcdCluster3, etcdCluster3OwnHTTP, etcdCluster3Auth)
		}
	}
	return out
}

// forEachBackend runs f b.N times as the sub-benchmark etcd=<backend> of
// each.
func forEachBackend(b *testing.B, f func(b *testing.B, backend string)) {
	for _, be := range scaleBackends(b) {
		b.Run("etcd="+be, func(b *testing.B) {
			for range b.N {
				f(b, be)
			}
		})
	}
}

// fleet is an etcd, a /12 pool of /26 blocks named pool, and 16 clients
// that simulated nodes share.
type fleet struct {
	b    *testing.B
	pool string
	clis []*clientv3.Client
	// status is the status of the member that leads (the only one when
	// embedded): its database size and raft term.
	status func(ctx context.Context) (*clientv3.StatusResponse, error)
	// callTimeout bounds each etcd request of the nodes' stores
	// (KVIPAM_CALL_TIMEOUT, as the agent's --etcd-call-timeout; default
	// the agent's, 1 s).
	callTimeout time.Duration
	// restoreRetries counts node starts whose restore etcd did not answer
	// in time, tried again (startNode).
	restoreRetries atomic.Int64
	// etcdCPU is the CPU the member processes have used; nil when etcd
	// runs in this process.
	etcdCPU func() (time.Duration, error)
	// etcdRSS is the largest resident memory of the member processes,
	// in bytes; nil when etcd runs in this process.
	etcdRSS func() (int64, error)
	// leaderProfile is a CPU profile of the leading member over d (with
	// KVIPAM_FILL_PROFILE set); nil when etcd runs in this process.
	leaderProfile func(ctx context.Context, d time.Duration) ([]byte, error)
	// steps, if set, times the store calls of the nodes fill starts
	// (while started).
	steps *stormSteps
}

// clusterFlags give the member processes the embedded etcd's compaction
// (kvstore.StartEmbedded), so both keep the same history.
var clusterFlags = []string{"--auto-compaction-mode=revision", "--auto-compaction-retention=10000"}

func newFleet(b *testing.B, backend, pool string) *fleet {
	f := &fleet{b: b, pool: pool, clis: make([]*clientv3.Client, 16), callTimeout: kvstore.DefaultCallTimeout}
	if s := os.Getenv("KVIPAM_CALL_TIMEOUT"); s != "" {
		d, err := time.ParseDuration(s)
		if err != nil {
			b.Fatalf("KVIPAM_CALL_TIMEOUT: %v", err)
		}
		f.callTimeout = d
	}
	switch backend {
	case etcdEmbed:
		e := etcdtest.Start(b)
		for i := range f.clis {
			f.clis[i] = etcdtest.Client(b, e)
		}
		f.status = func(ctx context.Context) (*clientv3.StatusResponse, error) {
			return f.clis[0].Status(ctx, e.Endpoints()[0])
		}
	case etcdCluster3, etcdCluster3OwnHTTP, etcdCluster3Auth:
		flags := clusterFlags
		if os.Getenv(profileEnv) != "" {
			flags = append(slices.Clone(flags), "--enable-pprof")
		}
		c := cluster.Start(b, cluster.Options{Members: 3, Flags: flags, OwnHTTPListener: backend == etcdCluster3OwnHTTP})
		if backend == etcdCluster3Auth {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			err := c.EnableAuth(ctx)
			if err == nil {
				err = c.AddUser(ctx, "kvipam", "", cluster.Role{Name: "fleet", Prefix: "/"})
			}
			cancel()
			if err != nil {
				b.Fatalf("etcd auth: %v", err)
			}
		}
		for i := range f.clis {
			f.clis[i] = c.Client(b, "kvipam")
		}
		f.status = func(ctx context.Context) (*clientv3.StatusResponse, error) {
			// While the members hold an election there is no leader to
			// ask: wait for one (a loaded machine delays heartbeats right
			// after the start).
			l, err := c.WaitLeader(ctx)
			if err != nil {
				return nil, err
			}
			return c.Status(ctx, l)
		}
		f.etcdCPU = c.CPUTime
		f.etcdRSS = c.MaxRSS
		f.leaderProfile = func(ctx context.Context, d time.Duration) ([]byte, error) { return leaderProfile(ctx, c, d) }
	default:
		b.Fatalf("no etcd %q", backend)
	}
	// KVIPAM_FLEET_CIDR: another pool (its blocks /26), to run a storm
	// at a smaller size with as large a share of the blocks taken.
	cidr, err := netip.ParsePrefix(cmp.Or(os.Getenv("KVIPAM_FLEET_CIDR"), "10.32.0.0/12"))
	if err != nil {
		b.Fatalf("KVIPAM_FLEET_CIDR: %v", err)
	}
	p := allocator.Pool{Name: pool, CIDRs: []netip.Prefix{cidr}, BlockSizeV4: 26}
	if _, err := etcdstore.New(f.clis[0], etcdstore.Options{}).EnsurePool(context.Background(), p); err != nil {
		b.Fatal(err)
	}
	return f
}

// term is the leader's raft term: it grows with every election.
func (f *fleet) term(ctx context.Context) uint64 {
	st, err := f.status(ctx)
	if err != nil {
		f.b.Fatalf("etcd status: %v", err)
	}
	return st.RaftTerm
}

// nodeName is simulated node i's name.
func nodeName(i int) string { return fmt.Sprintf("node-%05d", i) }

// start restores n node allocators, node-<first> on, each on its own lease
// of ttl seconds, 16 at a time (one per client, as agents starting
// together); wrap, if set, wraps each one's store.
func (f *fleet) start(ctx context.Context, first, n int, ttl int64, wrap func(records.Store) records.Store) ([]*nodealloc.Allocator, []*kvstore.Session) {
	als := make([]*nodealloc.Allocator, n)
	sessions := make([]*kvstore.Session, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for w := range len(f.clis) {
		wg.Go(func() {
			for i := w; i < n; i += len(f.clis) {
				als[i], sessions[i], errs[i] = f.startNode(ctx, first+i, ttl, wrap)
				if errs[i] != nil {
					return
				}
			}
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			f.b.Fatalf("start %s: %v", nodeName(first+i), err)
		}
	}
	return als, sessions
}

// startNode is one node's start: a new lease, a new allocator, its
// restore (tried again while etcd does not answer in time). The session is closed by the benchmark's cleanup.
func (f *fleet) startNode(ctx context.Context, i int, ttl int64, wrap func(records.Store) records.Store) (*nodealloc.Allocator, *kvstore.Session, error) {
	cli := f.clis[i%len(f.clis)]
	sess, err := kvstore.NewSession(ctx, cli, ttl)
	if err != nil {
		return nil, nil, err
	}
	f.b.Cleanup(sess.Close)
	var st records.Store = etcdstore.New(cli, etcdstore.Options{CallTimeout: f.callTimeout})
	if wrap != nil {
		st = wrap(st)
	}
	al, err := nodealloc.New(nodealloc.Config{Node: nodeName(i), Store: st})
	if err != nil {
		return nil, sess, err
	}
	// A restore etcd did not answer in time is tried again after a
	// back-off, as the agent's maintain loop does, and counted.
	// The start is not measured: on a loaded machine (10,000 nodes
	// starting beside three members on two cores) it is given a minute.
	err = al.Restore(ctx, sess)
	for try, began := 0, time.Now(); errors.Is(err, retry.ErrUnavailable) && time.Since(began) < time.Minute; try++ {
		f.restoreRetries.Add(1)
		time.Sleep(time.Duration(min(try+1, 10)) * 200 * time.Millisecond)
		err = al.Restore(ctx, sess)
	}
	return al, sess, err
}

// storm runs f for 0..n-1 at once and returns how long all took.
func storm(n int, f func(i int) error) time.Duration {
	took, _ := stormTimes(n, f)
	return took
}

// stormTimes is storm, also returning when each call ended, in ms after
// the start, in call order.
func stormTimes(n int, f func(i int) error) (time.Duration, []float64) {
	start := make(chan struct{})
	ends := make([]float64, n)
	var wg sync.WaitGroup
	var began time.Time
	for i := range n {
		wg.Go(func() {
			<-start
			_ = f(i)
			ends[i] = float64(time.Since(began)) / float64(time.Millisecond)
		})
	}
	began = time.Now()
	close(start)
	wg.Wait()
	return time.Since(began), ends
}

// answer is an allocation a node reported to its caller.
type answer struct {
	node  string
	owner records.Owner
	al    records.Allocation
}

// audit reads the pool's claims and allocations back from etcd and checks
// them against the answers. Duplicates (each must be 0) are: an address
// answered twice, a block answered by two nodes, an answered block whose
// claim in etcd names another node, an answered address whose record in
// etcd names another owner or node, and a record in etcd in a block
// claimed by another node than the record's. Missing are answered
// addresses with no record, and answered blocks with no claim (a claim
// goes with its node's lease).
func (f *fleet) audit(ctx context.Context, answers []answer) (dups, missing int) {
	blocks, err := etcdstore.New(f.clis[0], etcdstore.Options{}).ListBlocks(ctx, f.pool)
	if err != nil {
		f.b.Fatalf("audit: %v", err)
	}
	claimed := map[netip.Prefix]string{}
	for _, bi := range blocks {
		if bi.Claim != nil {
			claimed[bi.Block] = bi.Claim.Node
		}
	}
	kvs, err := readPrefix(ctx, f.clis[0], etcdstore.IPsPrefix(f.pool))
	if err != nil {
		f.b.Fatalf("audit: %v", err)
	}
	stored, err := agenttest.DecodeAllocations(f.pool, kvs)
	if err != nil {
		f.b.Fatalf("audit: %v", err)
	}
	records := map[netip.Addr]records.Record{}
	for _, al := range stored {
		records[al.Addr] = al.Record
		if n, ok := claimed[al.Block]; ok && n != al.Node && !al.Borrowed {
			dups++
			f.b.Logf("audit: %s of %s in block %s claimed by %s", al.Addr, al.Node, al.Block, n)
		}
	}
	addrs := map[netip.Addr]string{}
	blockOf := map[netip.Prefix]string{}
	for _, a := range answers {
		if prev, ok := addrs[a.al.Addr]; ok {
			dups++
			f.b.Logf("audit: %s answered to %s and %s", a.al.Addr, prev, a.owner.Key())
		}
		addrs[a.al.Addr] = a.owner.Key()
		if a.al.Borrowed { // in another node's block
			continue
		}
		if prev, ok := blockOf[a.al.Block]; ok && prev != a.node {
			dups++
			f.b.Logf("audit: block %s answered by %s and %s", a.al.Block, prev, a.node)
		}
		blockOf[a.al.Block] = a.node
		switch n, ok := claimed[a.al.Block]; {
		case !ok:
			missing++
		case n != a.node:
			dups++
			f.b.Logf("audit: %s answered block %s, claimed in etcd by %s", a.node, a.al.Block, n)
		}
		switch rec, ok := records[a.al.Addr]; {
		case !ok:
			missing++
		case rec.Owner.Key() != a.owner.Key() || rec.Node != a.node:
			dups++
			f.b.Logf("audit: %s answered to %s on %s, held in etcd by %s on %s", a.al.Addr, a.owner.Key(), a.node, rec.Owner.Key(), rec.Node)
		}
	}
	return dups, missing
}

// readPrefix reads every key under prefix, 5,000 a request.
func readPrefix(ctx context.Context, cli *clientv3.Client, prefix string) ([]*mvccpb.KeyValue, error) {
	end := clientv3.GetPrefixRangeEnd(prefix)
	var out []*mvccpb.KeyValue
	for key := prefix; ; {
		resp, err := cli.Get(ctx, key, clientv3.WithRange(end), clientv3.WithLimit(5000))
		if err != nil {
			return nil, err
		}
		out = append(out, resp.Kvs...)
		if !resp.More || len(resp.Kvs) == 0 {
			return out, nil
		}
		key = string(resp.Kvs[len(resp.Kvs)-1].Key) + "\x00"
	}
}

// quantile is the q-quantile (0 < q <= 1) of ds, sorted in place.
func quantile(ds []time.Duration, q float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	slices.Sort(ds)
	i := int(float64(len(ds))*q+0.999999) - 1
	return ds[min(max(i, 0), len(ds)-1)]
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func envInt(b *testing.B, name string, def int) int {
	s := os.Getenv(name)
	if s == "" {
		return def
	}
	v, err := strconv.Atoi(s)
	if err != nil {
		b.Fatalf("%s: %v", name, err)
	}
	return v
}

// envInts reads a comma-separated list of integers.
func envInts(b *testing.B, name, def string) []int {
	var out []int
	for _, s := range strings.Split(cmp.Or(os.Getenv(name), def), ",") {
		v, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil {
			b.Fatalf("%s: %v", name, err)
		}
		out = append(out, v)
	}
	return out
}
