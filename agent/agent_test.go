package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/agent/client"
	"github.com/kvipam/kvipam/agent/delqueue"
	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/testsupport/agenttest"
	"github.com/kvipam/kvipam/internal/testsupport/nstest"
	"github.com/kvipam/kvipam/kvstore"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

var testPool = allocator.Pool{Name: "default", BlockSizeV4: 27, BlockSizeV6: 120,
	CIDRs: []netip.Prefix{netip.MustParsePrefix("10.77.0.0/24"), netip.MustParsePrefix("fd00:77::/64")}}

// testAgent is an agent running in this process against a test etcd.
type testAgent struct {
	a    *Agent
	c    *client.Client
	stop context.CancelFunc
	done chan error
}

// socketPath returns a short socket path: unix socket paths are limited
// to 108 bytes, which t.TempDir() under a long test name can exceed.
func socketPath(t testing.TB) string {
	dir, err := os.MkdirTemp("", "kvipam-sock-")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	return filepath.Join(dir, "agent.sock")
}

func testConfig(t testing.TB, e *kvstore.Embedded) Config {
	c := DefaultConfig()
	c.Node = "node-1"
	c.StateDir = t.TempDir()
	c.Socket = socketPath(t)
	c.Etcd = EtcdConfig{Endpoints: e.Endpoints()}
	c.Pools = []allocator.Pool{testPool}
	c.MetricsAddr = ""
	c.Datapath = DatapathRoutes
	c.MTU = 1450
	c.RequestTimeout = Duration{3 * time.Second}
	c.GCInterval = Duration{time.Hour} // tests drive the reconciler by hand
	c.Routing = RoutingNone            // never route in the real host namespace
	return c
}

func startAgent(t testing.TB, cfg Config, o Options) *testAgent {
	t.Helper()
	a, err := New(cfg, o)
	require.NoError(t, err)
	return runAgent(t, a)
}

// runAgent runs a, which New built and the test may have changed since,
// until the test ends.
func runAgent(t testing.TB, a *Agent) *testAgent {
	t.Helper()
	cfg := a.cfg
	ctx, cancel := context.WithCancel(context.Background())
	ready := make(chan struct{})
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx, ready) }()
	select {
	case <-ready:
	case err := <-done:
		cancel()
		t.Fatalf("agent did not start: %v", err)
	}
	ta := &testAgent{a: a, c: client.New(cfg.Socket, 5*time.Second), stop: cancel, done: done}
	t.Cleanup(ta.shutdown)
	return ta
}

func (ta *testAgent) shutdown() {
	ta.stop()
	<-ta.done
	ta.done <- nil // let a second shutdown return at once
}

func owner(i int) api.Owner {
	return api.Owner{ContainerID: fmt.Sprintf("ctr-%04d", i), IfName: "eth0", Namespace: "ns", Pod: fmt.Sprintf("pod-%d", i)}
}

func apiErr(t testing.TB, err error) *api.Error {
	t.Helper()
	var ae *api.Error
	require.ErrorAs(t, err, &ae)
	return ae
}

func TestAPIRefusesBadInput(t *testing.T) {
	e := etcdtest.Start(t)
	ta := startAgent(t, testConfig(t, e), Options{})
	ctx := context.Background()
	for _, tc := range []struct {
		name   string
		req    api.AllocateRequest
		status int
		field  string
	}{
		{"no container id", api.AllocateRequest{Owner: api.Owner{IfName: "eth0"}}, 400, "owner.containerID"},
		{"no ifname", api.AllocateRequest{Owner: api.Owner{ContainerID: "c"}}, 400, "owner.ifName"},
		{"bad ifname", api.AllocateRequest{Owner: api.Owner{ContainerID: "c", IfName: "a/b"}}, 400, "owner.ifName"},
		{"unknown pool", api.AllocateRequest{Owner: owner(1), Pool: "nope"}, 400, "pool"},
		{"bad family", api.AllocateRequest{Owner: owner(1), Families: []string{"ipv5"}}, 400, "families[0]"},
		{"ip outside pool", api.AllocateRequest{Owner: owner(1), IPs: api.Addrs{netip.MustParseAddr("192.0.2.1")}}, 400, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ta.c.Allocate(ctx, tc.req)
			ae := apiErr(t, err)
			require.Equal(t, tc.status, ae.Status, ae.Message)
			require.Equal(t, api.CodeBadRequest, ae.Code)
			require.Equal(t, tc.field, ae.Field, ae.Message)
		})
	}
	// A malformed address cannot be sent through the typed client: its
	// JSON is refused while decoding, naming the entry.
	for _, tc := range []struct {
		name, path, body, field string
	}{
		{"bad ip", api.PathAllocate, `{"owner":{"containerID":"c","ifName":"eth0"},"ips":["10.77.0.300"]}`, "ips[0]"},
		{"bad second ip", api.PathAllocate, `{"owner":{"containerID":"c","ifName":"eth0"},"ips":["10.77.0.5","nope"]}`, "ips[1]"},
		{"empty ip", api.PathAllocate, `{"owner":{"containerID":"c","ifName":"eth0"},"ips":[""]}`, "ips[0]"},
		{"cidr ip: the plugin sends the address alone", api.PathAllocate, `{"owner":{"containerID":"c","ifName":"eth0"},"ips":["10.77.0.5/24"]}`, "ips[0]"},
		{"ip not a string", api.PathAllocate, `{"owner":{"containerID":"c","ifName":"eth0"},"ips":[5]}`, "ips"},
		{"bad endpoint ip", api.PathEndpoints, `{"owner":{"containerID":"c","ifName":"eth0"},"hostIfName":"kvx","ips":["10.77.0.5/33"]}`, "ips[0]"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			status, ae := rawPost(t, ta.a.cfg.Socket, tc.path, tc.body)
			require.Equal(t, 400, status, ae.Message)
			require.Equal(t, api.CodeBadRequest, ae.Code)
			require.Equal(t, tc.field, ae.Field, ae.Message)
		})
	}
	t.Run("endpoint without reservation", func(t *testing.T) {
		_, err := ta.c.CreateEndpoint(ctx, api.EndpointRequest{Owner: owner(9), HostIfName: "kvx", IPs: api.Prefixes{netip.MustParsePrefix("10.77.0.5/32")}})
		require.Equal(t, api.CodeNotFound, apiErr(t, err).Code)
	})
	// Nothing was written by any refused request.
	resp, err := etcdtest.Client(t, e).Get(ctx, etcdstore.IPsPrefix("default"), clientv3.WithPrefix(), clientv3.WithCountOnly())
	require.NoError(t, err)
	require.Zero(t, resp.Count)
}

func TestAPIBodyLimits(t *testing.T) {
	e := etcdtest.Start(t)
	cfg := testConfig(t, e)
	startAgent(t, cfg, Options{})
	for _, tc := range []struct {
		name, body string
		status     int
		code       string
		field      string
	}{
		{"unknown field", `{"owner":{"containerID":"c","ifName":"eth0"},"x":1}`, 400, api.CodeBadRequest, "x"},
		{"wrong type", `{"owner":{"containerID":5,"ifName":"eth0"}}`, 400, api.CodeBadRequest, "owner.containerID"},
		{"not json", `{{`, 400, api.CodeBadRequest, ""},
		{"empty", ``, 400, api.CodeBadRequest, ""},
		{"too large", `{"owner":{"containerID":"` + strings.Repeat("a", api.MaxBodyBytes) + `"}}`, 413, api.CodeTooLarge, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			status, ae := rawPost(t, cfg.Socket, api.PathAllocate, tc.body)
			require.Equal(t, tc.status, status)
			require.Equal(t, tc.code, ae.Code)
			require.Equal(t, tc.field, ae.Field)
		})
	}
}

func TestAllocateEndpointRelease(t *testing.T) {
	host := nstest.NewNS(t)
	h := nstest.Handle(t, host)
	link := nstest.AddLink(t, h, "kvtest0")
	e := etcdtest.Start(t)
	cfg := testConfig(t, e)
	cfg.NetNS = host.Path()
	ta := startAgent(t, cfg, Options{})
	ctx := context.Background()
	cli := etcdtest.Client(t, e)

	res, err := ta.c.Allocate(ctx, api.AllocateRequest{Owner: owner(1)})
	require.NoError(t, err)
	require.Equal(t, "reserved", res.State)
	require.NotNil(t, res.Expires)
	require.Len(t, res.IPs, 2)
	require.Equal(t, 1450, res.MTU)
	again, err := ta.c.Allocate(ctx, api.AllocateRequest{Owner: owner(1)})
	require.NoError(t, err)
	require.Equal(t, res.IPs, again.IPs, "a retried ADD gets the same addresses")
	held, err := ta.c.Allocations(ctx, owner(1))
	require.NoError(t, err)
	require.Len(t, held, 2)
	require.Equal(t, "reserved", held[0].State)
	none, err := ta.c.Allocations(ctx, owner(2))
	require.NoError(t, err)
	require.Empty(t, none)

	var ips api.Prefixes
	for _, ip := range res.IPs {
		ips = append(ips, ip.Address)
	}
	ep, err := ta.c.CreateEndpoint(ctx, api.EndpointRequest{Owner: owner(1), HostIfName: "kvtest0", IPs: ips})
	require.NoError(t, err)
	require.Equal(t, link.Attrs().Index, ep.HostIfIndex)
	for _, al := range storeIPs(t, cli) {
		require.Equal(t, records.StateAllocated, al.State, "endpoint create made the reservation permanent")
		require.Zero(t, al.Lease)
	}
	eps, err := ta.c.Endpoints(ctx)
	require.NoError(t, err)
	require.Len(t, eps, 1)

	_, err = ta.c.CreateEndpoint(ctx, api.EndpointRequest{Owner: owner(2), HostIfName: "kvtest0", IPs: ips})
	require.Equal(t, api.CodeNotFound, apiErr(t, err).Code, "another owner cannot take these IPs")

	rel, err := ta.c.Release(ctx, owner(1))
	require.NoError(t, err)
	require.Len(t, rel.Released, 2)
	require.Empty(t, storeIPs(t, cli))
	eps, err = ta.c.Endpoints(ctx)
	require.NoError(t, err)
	require.Empty(t, eps)
	rel, err = ta.c.Release(ctx, owner(1))
	require.NoError(t, err, "a second release succeeds")
	require.Empty(t, rel.Released)
}

func storeIPs(t testing.TB, cli *clientv3.Client) []records.Allocation {
	t.Helper()
	resp, err := cli.Get(context.Background(), etcdstore.IPsPrefix("default"), clientv3.WithPrefix())
	require.NoError(t, err)
	out, err := agenttest.DecodeAllocations("default", resp.Kvs)
	require.NoError(t, err)
	return out
}

// TestGroupCommit sends 200 concurrent allocations through the socket and
// counts etcd revisions: each transaction is one revision.
func TestGroupCommit(t *testing.T) {
	e := etcdtest.Start(t)
	cfg := testConfig(t, e)
	cfg.Pools = []allocator.Pool{{Name: "default", BlockSizeV4: 24, CIDRs: []netip.Prefix{netip.MustParsePrefix("10.78.0.0/16")}}}
	ta := startAgent(t, cfg, Options{})
	ctx := context.Background()
	cli := etcdtest.Client(t, e)
	// Claim the first block up front so the count is of allocations only.
	_, err := ta.c.Allocate(ctx, api.AllocateRequest{Owner: owner(10000), Permanent: true})
	require.NoError(t, err)
	before := revision(t, cli)

	const n = 200
	var wg sync.WaitGroup
	addrs := make([]netip.Prefix, n)
	errs := make([]error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r, err := ta.c.Allocate(ctx, api.AllocateRequest{Owner: owner(i), Permanent: true})
			errs[i] = err
			if err == nil {
				addrs[i] = r.IPs[0].Address
			}
		}()
	}
	wg.Wait()
	seen := map[netip.Prefix]bool{}
	for i := range n {
		require.NoError(t, errs[i])
		require.False(t, seen[addrs[i]], "duplicate %s", addrs[i])
		seen[addrs[i]] = true
	}
	txns := revision(t, cli) - before

	t.Logf("200 concurrent allocations took %d etcd write transactions (mean batch %.1f)", txns, float64(n)/float64(txns))
	// How many share a transaction depends on how the callers are
	// scheduled (a mean of 4 under a CPU hog, 10 or more idle); without
	// the group commit each would take its own.
	require.Less(t, txns, int64(n/2), "group commit batches concurrent allocations")
	require.Len(t, storeIPs(t, cli), n+1)
}

func revision(t testing.TB, cli *clientv3.Client) int64 {
	resp, err := cli.Get(context.Background(), "/", clientv3.WithCountOnly())
	require.NoError(t, err)
	return resp.Header.Revision
}

func TestGCRequest(t *testing.T) {
	e := etcdtest.Start(t)
	cfg := testConfig(t, e)
	cfg.GCGrace = Duration{time.Hour}
	ta := startAgent(t, cfg, Options{})
	ctx := context.Background()
	for i := range 4 {
		_, err := ta.c.Allocate(ctx, api.AllocateRequest{Owner: owner(i), Permanent: true, Families: []string{"ipv4"}})
		require.NoError(t, err)
	}
	valid := []api.Attachment{{ContainerID: owner(0).ContainerID, IfName: "eth0"}, {ContainerID: owner(1).ContainerID, IfName: "eth0"}}
	res, err := ta.c.GC(ctx, api.GCRequest{ValidAttachments: valid})
	require.NoError(t, err)
	require.Empty(t, res.Released, "nothing younger than the grace period is collected")
	require.Equal(t, 2, res.Deferred)

	// An hour later (the agent's clock, driven by the test) they go.
	out, err := ta.a.gc.collect(ctx, api.GCRequest{ValidAttachments: valid}, time.Now().Add(2*time.Hour))
	require.NoError(t, err)
	require.Len(t, out.Released, 2)
	left := storeIPs(t, etcdtest.Client(t, e))
	require.Len(t, left, 2)
	for _, al := range left {
		require.Contains(t, []string{owner(0).ContainerID, owner(1).ContainerID}, al.ContainerID)
	}
	// GC is scoped to a network: another network's attachment in the same
	// pool is not collected by this network's GC.
	other := api.Owner{ContainerID: "other-net", IfName: "net1", Network: "net-b"}
	_, err = ta.c.Allocate(ctx, api.AllocateRequest{Owner: other, Permanent: true, Families: []string{"ipv4"}})
	require.NoError(t, err)
	out, err = ta.a.gc.collect(ctx, api.GCRequest{ValidAttachments: valid, Network: "net-a"}, time.Now().Add(2*time.Hour))
	require.NoError(t, err)
	require.Empty(t, out.Released, "net-a's GC leaves net-b's attachment alone")
	out, err = ta.a.gc.collect(ctx, api.GCRequest{ValidAttachments: valid, Network: "net-b"}, time.Now().Add(2*time.Hour))
	require.NoError(t, err)
	require.Len(t, out.Released, 1, "net-b's own GC collects it")

	_, err = ta.c.GC(ctx, api.GCRequest{ValidAttachments: []api.Attachment{{ContainerID: "x"}}})
	require.Equal(t, "validAttachments[0]", apiErr(t, err).Field)
}

func TestReconcilerReleasesVanishedEndpoint(t *testing.T) {
	host := nstest.NewNS(t)
	h := nstest.Handle(t, host)
	e := etcdtest.Start(t)
	cfg := testConfig(t, e)
	cfg.GCGrace = Duration{time.Minute}
	cfg.NetNS = host.Path()
	ta := startAgent(t, cfg, Options{})
	ctx := context.Background()
	for i, name := range []string{"kvkeep", "kvgone"} {
		nstest.AddLink(t, h, name)
		_, err := ta.c.Allocate(ctx, api.AllocateRequest{Owner: owner(i)})
		require.NoError(t, err)
		_, err = ta.c.CreateEndpoint(ctx, api.EndpointRequest{Owner: owner(i), HostIfName: name})
		require.NoError(t, err)
	}
	gone, err := h.LinkByName("kvgone")
	require.NoError(t, err)
	require.NoError(t, h.LinkDel(gone)) // as when the pod netns is deleted without DEL

	now := time.Now()
	require.Zero(t, ta.a.rec.pass(ctx, now), "the first pass only suspects")
	require.Zero(t, ta.a.rec.pass(ctx, now.Add(30*time.Second)), "still within the grace period")
	require.Equal(t, 1, ta.a.rec.pass(ctx, now.Add(61*time.Second)), "released after the grace period and a re-check")
	eps, err := ta.c.Endpoints(ctx)
	require.NoError(t, err)
	require.Len(t, eps, 1)
	require.Equal(t, "kvkeep", eps[0].HostIfName)
	left := storeIPs(t, etcdtest.Client(t, e))
	require.Len(t, left, 2, "only the kept endpoint's two addresses remain")
	for _, al := range left {
		require.Equal(t, owner(0).ContainerID, al.ContainerID)
	}
}

// TestEtcdOutageLongerThanLease stops etcd for longer than the lease TTL:
// allocations fail fast with try-again, and when etcd is back the agent
// takes a new lease, re-claims its blocks and keeps every address.
func TestEtcdOutageLongerThanLease(t *testing.T) {
	dir := t.TempDir()
	url := "http://" + freeAddr(t)
	peer := "http://" + freeAddr(t)
	start := func() *kvstore.Embedded {
		e, err := kvstore.StartEmbedded(context.Background(), kvstore.EmbedConfig{Dir: dir, ClientURL: url, PeerURL: peer, Fast: true})
		require.NoError(t, err)
		return e
	}
	e := start()
	cfg := testConfig(t, e)
	cfg.LeaseTTL = Duration{2 * time.Second}
	cfg.RequestTimeout = Duration{2 * time.Second}
	ta := startAgent(t, cfg, Options{})
	ctx := context.Background()
	var before []api.IPConfig
	for i := range 5 {
		r, err := ta.c.Allocate(ctx, api.AllocateRequest{Owner: owner(i), Permanent: true})
		require.NoError(t, err)
		before = append(before, r.IPs...)
	}
	lease := ta.a.lease.session()
	e.Close()
	<-lease.Done() // the keepalive gives up once the TTL has passed

	t0 := time.Now()
	_, err := ta.c.Allocate(ctx, api.AllocateRequest{Owner: owner(100)})
	ae := apiErr(t, err)
	require.Equal(t, api.CodeTryAgain, ae.Code, ae.Message)
	require.Equal(t, 503, ae.Status)
	require.Less(t, time.Since(t0), time.Second, "fails fast, does not wait for etcd")
	st, err := ta.c.Status(ctx)
	require.NoError(t, err)
	require.False(t, st.Ready)
	require.Equal(t, "lost", st.Lease.State)

	e = start()
	defer e.Close()
	require.NoError(t, waitReady(ta.c, 20*time.Second))
	st, err = ta.c.Status(ctx)
	require.NoError(t, err)
	require.Equal(t, "held", st.Lease.State)
	require.NotEqual(t, lease.ID(), st.Lease.ID, "a new lease")
	var after []api.IPConfig
	for i := range 5 {
		r, err := ta.c.Allocate(ctx, api.AllocateRequest{Owner: owner(i), Permanent: true})
		require.NoError(t, err)
		after = append(after, r.IPs...)
	}
	require.Equal(t, before, after, "every address survived the outage")
	_, err = ta.c.Allocate(ctx, api.AllocateRequest{Owner: owner(101)})
	require.NoError(t, err, "new allocations work")
	blocks, err := etcdstore.New(etcdtest.Client(t, e), etcdstore.Options{}).ListBlocks(ctx, "default")
	require.NoError(t, err)
	for _, b := range blocks {
		require.Equal(t, st.Lease.ID, b.ClaimLease, "block %s re-claimed on the new lease", b.Block)
	}
}

// waitReady polls the agent's health: readiness after an outage has no
// event the test can subscribe to.
func waitReady(c *client.Client, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		st, err := c.Status(context.Background())
		if err == nil && st.Ready {
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	return errors.New("agent not ready in time")
}

func TestMetricsEndpoint(t *testing.T) {
	e := etcdtest.Start(t)
	cfg := testConfig(t, e)
	cfg.MetricsAddr = freeAddr(t)
	ta := startAgent(t, cfg, Options{})
	_, err := ta.c.Allocate(context.Background(), api.AllocateRequest{Owner: owner(1)})
	require.NoError(t, err)
	resp, err := http.Get("http://" + cfg.MetricsAddr + "/metrics")
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	for _, want := range []string{
		`kvipam_pool_allocated_addresses{family="ipv4",pool="default"} 1`,
		`kvipam_pool_pending_reservations{family="ipv6",pool="default"} 1`,
		`kvipam_pool_borrowed_addresses{family="ipv4",pool="default"} 0`,
		`kvipam_blocks_owned{family="ipv4",pool="default"} 1`,
		`kvipam_node_free_addresses{family="ipv4",pool="default"} 31`,
		`kvipam_pool_size_addresses{family="ipv4",pool="default"} 254`,
		`kvipam_pool_reserved_addresses{family="ipv4",pool="default"} 0`,
		`kvipam_pool_blocks{family="ipv4",pool="default",state="claimed"} 1`,
		`kvipam_pool_blocks{family="ipv4",pool="default",state="free"} 7`,
		`kvipam_pool_blocks{family="ipv4",pool="default",state="orphaned"} 0`,
		`kvipam_pool_disabled{pool="default"} 0`,
		`kvipam_leak_candidates{pool="default"} 0`,
		`kvipam_etcd_txn_duration_seconds_count{op="claim"} 2`,
		`kvipam_allocation_batch_size_count 1`,
		`kvipam_lease_held 1`,
		`kvipam_api_requests_total{code="200",path="/v1/allocate"} 1`,
		`,version="dev"} 1`, // kvipam_build_info (TestBuildInfoMetric): Options.Version's default
	} {
		require.Contains(t, string(body), want)
	}
}

// TestQueuedDelAppliedAtStart: a DEL queued by a plugin while the agent
// was down is applied before the agent serves.
func TestQueuedDelAppliedAtStart(t *testing.T) {
	e := etcdtest.Start(t)
	cfg := testConfig(t, e)
	ta := startAgent(t, cfg, Options{})
	ctx := context.Background()
	for i := range 3 {
		_, err := ta.c.Allocate(ctx, api.AllocateRequest{Owner: owner(i), Permanent: true})
		require.NoError(t, err)
	}
	ta.shutdown()
	require.NoError(t, delqueue.Enqueue(cfg.delQueueDir(), owner(1)))
	require.NoError(t, delqueue.Enqueue(cfg.delQueueDir(), api.Owner{ContainerID: "never-seen", IfName: "eth0"}))

	startAgent(t, cfg, Options{})
	left := storeIPs(t, etcdtest.Client(t, e))
	require.Len(t, left, 4, "owner 1's two addresses were released")
	for _, al := range left {
		require.NotEqual(t, owner(1).ContainerID, al.ContainerID)
	}
	queued, err := delqueue.List(cfg.delQueueDir())
	require.NoError(t, err)
	require.Empty(t, queued, "the queue is drained, including a DEL of an owner that holds nothing")
}
