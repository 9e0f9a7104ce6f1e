package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/agent/client"
	"github.com/kvipam/kvipam/e2e/cluster"
	"github.com/kvipam/kvipam/internal/testsupport/nstest"
)

// Addresses the host namespace of every node has, for pods to reach.
var (
	hostAddrV4 = netip.MustParseAddr("192.0.2.1")
	hostAddrV6 = netip.MustParseAddr("2001:db8::1")
)

// node is one simulated node: a host network namespace, with its own
// kvipam-agent (with an embedded etcd asked for by name, unless the test
// gives an etcd) and libcni configured like a runtime's.
type node struct {
	t        testing.TB
	name     string
	bin      string
	host     ns.NetNS
	dir      string // state, cache, queues; short, so the socket path fits
	socket   string
	queue    string // the plugins' DEL queue (delQueueDir in the conflists)
	agentLog string
	cni      *libcni.CNIConfig

	agent     *exec.Cmd
	agentDone chan struct{}
	agentArgs agentOpts
}

// agentOpts are the agent's flags that tests vary.
type agentOpts struct {
	pools          []string // NAME=CIDR[,CIDR...]
	blockV4        int
	reservationTTL time.Duration
	// queue is the agent's --del-queue-dir; the plugins' queue when empty.
	queue string
	// datapath overrides KVIPAM_E2E_DATAPATH (default routes).
	datapath string
	// gcInterval is the reconciler's period (default 30s).
	gcInterval time.Duration
	// extra are more agent flags.
	extra []string
	// etcd, if set, is the etcd cluster (member processes on the test
	// host's loopback) the agent uses. Such an
	// agent runs in the test's own namespace, where that loopback is, and
	// manages the node namespace through --netns; its plugins still run in
	// the node namespace and reach it over its unix socket.
	etcd *cluster.Cluster
	// etcdEndpoints, if set, replace the cluster's endpoints (proxies in
	// front of its members, which a test can cut).
	etcdEndpoints []string
	// etcdURL, if set, is another node's embedded etcd (plain http) that
	// the agent uses. An agent given neither etcd nor etcdURL asks for an
	// embedded etcd of its own by name (--etcd-embedded): the agent never
	// runs one unasked.
	etcdURL string
	// reuseAtOnce seeds the pools with a reuse cooldown of 0 (a pool
	// setting, which the --pool flag cannot carry: the pools go in a
	// configuration file instead).
	reuseAtOnce bool
	// inNode runs an agent of etcd in the node namespace all the same,
	// as a BGP speaker must (its sessions are the process's): its
	// etcdEndpoints must listen there.
	inNode bool
	// bgp, if set, is the bgp section of the agent's configuration file.
	bgp map[string]any
}

// configFile writes the agent's configuration file for what flags cannot
// say: o's pools (NAME=CIDR[,CIDR...], blocks of o.blockV4 and /120) with a
// reuse cooldown of 0 when o.reuseAtOnce, and o.bgp; it returns its path.
func (n *node) configFile(o agentOpts) string {
	n.t.Helper()
	cfg := map[string]any{}
	if o.reuseAtOnce {
		var pools []any
		for _, p := range o.pools {
			name, cidrs, ok := strings.Cut(p, "=")
			require.True(n.t, ok, "pool %q", p)
			pool := map[string]any{"name": name, "cidrs": strings.Split(cidrs, ","), "reuseCooldown": "0s"}
			if strings.Contains(cidrs, ".") {
				pool["blockSizeV4"] = o.blockV4
			}
			if strings.Contains(cidrs, ":") {
				pool["blockSizeV6"] = 120
			}
			pools = append(pools, pool)
		}
		cfg["pools"] = pools
	}
	if o.bgp != nil {
		cfg["bgp"] = o.bgp
	}
	b, err := json.Marshal(cfg) // JSON is YAML
	require.NoError(n.t, err)
	path := filepath.Join(n.dir, "agent-config.yaml")
	require.NoError(n.t, os.WriteFile(path, b, 0o600))
	return path
}

// newNode makes a node namespace: lo up with hostAddrV4 and hostAddrV6, an
// uplink veth (as a node has a NIC), and forwarding on, which a node
// running pods has. It starts no agent.
func newNode(t testing.TB, name string) *node {
	t.Helper()
	bin := bins(t)
	dir, err := os.MkdirTemp("", "kv-"+name+"-")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	n := &node{
		t: t, name: name, host: newNS(t), dir: dir,
		socket: filepath.Join(dir, "agent.sock"), queue: filepath.Join(dir, "plugin-del-queue"),
		agentLog: filepath.Join(dir, "agent.log"),
	}
	n.useBins(bin)

	h := nlHandle(t, n.host)
	lo, err := h.LinkByName("lo")
	require.NoError(t, err)
	for _, a := range []netip.Addr{hostAddrV4, hostAddrV6} {
		require.NoError(t, h.AddrAdd(lo, &netlink.Addr{IPNet: ipNet(netip.PrefixFrom(a, a.BitLen())), Flags: unix.IFA_F_NODAD}))
	}
	la := netlink.NewLinkAttrs()
	la.Name = "uplink0"
	require.NoError(t, h.LinkAdd(&netlink.Veth{LinkAttrs: la, PeerName: "uplink1"}))
	require.NoError(t, n.do(func() error {
		for _, kv := range [][2]string{{"ipv4/ip_forward", "1"}, {"ipv6/conf/all/forwarding", "1"}} {
			if err := os.WriteFile("/proc/sys/net/"+kv[0], []byte(kv[1]), 0o644); err != nil {
				return err
			}
		}
		return nil
	}))
	return n
}

// useBins makes dir the node's directory of binaries: its agent's,
// kvipamctl's and its CNI plugins'. Call it before the node is used (its
// plugins run while the test runs, from other goroutines).
func (n *node) useBins(dir string) {
	n.bin = dir
	n.cni = libcni.NewCNIConfigWithCacheDir([]string{dir}, filepath.Join(n.dir, "cni-cache"), nil)
}

// do runs f with the calling thread in the node's host namespace: a
// plugin or agent started from f runs there.
func (n *node) do(f func() error) error {
	return n.host.Do(func(ns.NetNS) error { return f() })
}

// startAgent starts kvipam-agent in the node namespace and waits for its
// socket. It is stopped (SIGTERM) at cleanup.
func (n *node) startAgent(o agentOpts) {
	t := n.t
	t.Helper()
	if o.blockV4 == 0 {
		o.blockV4 = 26
	}
	if o.reservationTTL == 0 {
		o.reservationTTL = 2 * time.Minute
	}
	if o.queue == "" {
		o.queue = n.queue
	}
	if o.datapath == "" {
		o.datapath = datapathFlag()
	}
	n.agentArgs = o
	args := []string{
		"--node", n.name, "--state-dir", filepath.Join(n.dir, "state"), "--socket", n.socket,
		"--block-size-v4", fmt.Sprint(o.blockV4), "--block-size-v6", "120",
		"--lease-ttl", "15s", "--reservation-ttl", o.reservationTTL.String(),
		"--datapath", o.datapath, "--mtu", "1500", "--metrics-addr", "", "--gc-grace", "0s",
		"--del-queue-dir", o.queue, "--log-level", "debug",
	}
	if o.reuseAtOnce || o.bgp != nil {
		args = append(args, "--config", n.configFile(o))
	}
	if !o.reuseAtOnce {
		for _, p := range o.pools {
			args = append(args, "--pool", p)
		}
	}
	if o.gcInterval > 0 {
		args = append(args, "--gc-interval", o.gcInterval.String())
	}
	args = append(args, o.extra...)
	in := n.host
	switch {
	case o.etcdURL != "":
		args = append(args, "--etcd-endpoints", o.etcdURL)
	case o.etcd == nil:
		args = append(args, "--etcd-embedded")
	default:
		f, err := o.etcd.ClientConfig(cluster.RootUser)
		require.NoError(t, err)
		endpoints := o.etcd.Endpoints()
		if o.etcdEndpoints != nil {
			endpoints = o.etcdEndpoints
		}
		args = append(args, "--etcd-endpoints", strings.Join(endpoints, ","),
			"--etcd-cacert", f.CAFile, "--etcd-cert", f.CertFile, "--etcd-key", f.KeyFile)
		if !o.inNode {
			args = append(args, "--netns", n.host.Path())
			in = nil
		}
	}
	if o.datapath != "routes" {
		// bpffs is the host's: give each node its own pin directory.
		pins := filepath.Join("/sys/fs/bpf", "kvipam-e2e-"+filepath.Base(n.dir))
		args = append(args, "--bpf-pin-dir", pins)
		t.Cleanup(func() { _ = os.RemoveAll(pins) })
	}
	logf, err := os.OpenFile(n.agentLog, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
	require.NoError(t, err)
	defer logf.Close()
	cmd := exec.Command(filepath.Join(n.bin, "kvipam-agent"), args...)
	cmd.Env = []string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin", "KVIPAM_LOG_JSON=1"}
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	require.NoError(t, startIn(in, cmd))
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	n.agent, n.agentDone = cmd, done
	t.Cleanup(n.stopAgent)

	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	go func() {
		select {
		case <-done:
			cancel() // it exited: stop waiting
		case <-ctx.Done():
		}
	}()
	if err := client.New(n.socket, 5*time.Second).WaitReady(ctx); err != nil {
		state := "running"
		select {
		case <-done:
			state = cmd.ProcessState.String()
		default:
		}
		t.Fatalf("agent %s not ready (%s): %v\n%s", n.name, state, err, n.logTail())
	}
}

// stopAgent stops the agent as a service manager would (SIGTERM), and
// waits for it.
func (n *node) stopAgent() { n.signalAgent(syscall.SIGTERM) }

// killAgent kills the agent (and its embedded etcd) at once.
func (n *node) killAgent() { n.signalAgent(syscall.SIGKILL) }

func (n *node) signalAgent(sig syscall.Signal) {
	if n.agent == nil {
		return
	}
	_ = n.agent.Process.Signal(sig)
	select {
	case <-n.agentDone:
	case <-time.After(30 * time.Second):
		_ = n.agent.Process.Kill()
		<-n.agentDone
	}
	n.agent = nil
}

// restartAgent starts the agent again with the options it had.
func (n *node) restartAgent() {
	n.t.Helper()
	n.stopAgent()
	n.startAgent(n.agentArgs)
}

func (n *node) logTail() string {
	b, _ := os.ReadFile(n.agentLog)
	if len(b) > 4000 {
		b = b[len(b)-4000:]
	}
	return string(b)
}

// client talks to the node's agent.
func (n *node) client() *client.Client { return client.New(n.socket, 10*time.Second) }

// status is the agent's status.
func (n *node) status() *api.Status {
	n.t.Helper()
	st, err := n.client().Status(context.Background())
	require.NoError(n.t, err)
	return st
}

// poolStatus is one pool family of the agent's status.
func (n *node) poolStatus(pool, family string) api.PoolStatus {
	n.t.Helper()
	for _, ps := range n.status().Pools {
		if ps.Pool == pool && ps.Family == family {
			return ps
		}
	}
	n.t.Fatalf("agent %s has no pool %s/%s", n.name, pool, family)
	return api.PoolStatus{}
}

// etcdEndpoint is the client URL of the agent's embedded etcd, from its
// log.
func (n *node) etcdEndpoint() string {
	n.t.Helper()
	f, err := os.Open(n.agentLog)
	require.NoError(n.t, err)
	defer f.Close()
	var ep string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var line struct {
			Message   string   `json:"@message"`
			Endpoints []string `json:"endpoints"`
		}
		if json.Unmarshal(sc.Bytes(), &line) == nil && line.Message == "started embedded etcd" && len(line.Endpoints) > 0 {
			ep = line.Endpoints[0] // the last start wins
		}
	}
	if ep == "" {
		n.t.Fatalf("no embedded etcd endpoint in the agent log:\n%s", n.logTail())
	}
	return ep
}

// newNS makes a network namespace with lo up, removed at cleanup.
func newNS(t testing.TB) ns.NetNS {
	t.Helper()
	requireRoot(t)
	return nstest.NewNS(t)
}

func nlHandle(t testing.TB, n ns.NetNS) *netlink.Handle { return nstest.Handle(t, n) }

// waitFor polls cond until it holds or the deadline passes. It is for
// state with no event to wait on (an etcd lease expiring in another
// process).
func waitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func datapathFlag() string {
	if d := os.Getenv("KVIPAM_E2E_DATAPATH"); d != "" {
		return d
	}
	return "routes"
}

// clusterCtl returns a runner of n's kvipamctl against cluster c as its
// root user (TLS): it appends the endpoints and client files to args.
func (n *node) clusterCtl(c *cluster.Cluster) func(args ...string) ([]byte, error) {
	n.t.Helper()
	return clusterCtl(n.t, c, n.bin)
}

// clusterCtl returns a runner of bin's kvipamctl against cluster c as
// its root user (TLS).
func clusterCtl(t testing.TB, c *cluster.Cluster, bin string) func(args ...string) ([]byte, error) {
	t.Helper()
	f, err := c.ClientConfig(cluster.RootUser)
	require.NoError(t, err)
	return func(args ...string) ([]byte, error) {
		args = append(args, "--endpoints", strings.Join(c.Endpoints(), ","), "--cacert", f.CAFile, "--cert", f.CertFile, "--key", f.KeyFile)
		return exec.Command(filepath.Join(bin, "kvipamctl"), args...).CombinedOutput()
	}
}
