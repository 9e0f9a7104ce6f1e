package main

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/agent/client"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/e2e/cluster"
	"github.com/kvipam/kvipam/internal/testsupport/nstest"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

func TestBadConfigurationExits(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"bad node label", []string{"--node-labels", "rack"}, "node-labels"},
		{"bad cidr", []string{"--pool", "p=10.0.0.1/33"}, "invalid value"},
		{"bad datapath", []string{"--pool", "p=10.0.0.0/16", "--datapath", "magic"}, `datapath: "magic"`},
		{"tiny lease", []string{"--pool", "p=10.0.0.0/16", "--lease-ttl", "1s"}, "lease-ttl"},
		{"block larger than cidr", []string{"--pool", "p=10.0.0.0/28", "--block-size-v4", "26"}, "larger than cidr"},
		{"bad default pool", []string{"--pool", "p=10.0.0.0/16", "--default-pool", "Q!"}, "default-pool"},
		{"pool in a special range", []string{"--pool", "p=169.254.0.0/16"}, "cidr 169.254.0.0/16 overlaps 169.254.0.0/16, IPv4 link-local"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, code := runAgent(t, tc.args, nil)
			require.Equal(t, 2, code, out)
			require.Contains(t, out, tc.want)
		})
	}
	t.Run("env and version", func(t *testing.T) {
		out, code := runAgent(t, []string{"--version"}, nil)
		require.Equal(t, 0, code)
		require.Contains(t, out, "kvipam-agent")
		sub, code := runAgent(t, []string{"version"}, nil)
		require.Equal(t, 0, code)
		require.Equal(t, out, sub, "version works like --version")
		out, code = runAgent(t, nil, []string{"KVIPAM_POOL=p=10.0.0.0/16", "KVIPAM_DATAPATH=nope"})
		require.Equal(t, 2, code)
		require.Contains(t, out, `datapath: "nope"`, "environment variables configure the agent")
	})
}

var agentBin string

// buildAgent builds this command once per test binary run.
func buildAgent(t testing.TB) string {
	t.Helper()
	if agentBin != "" {
		return agentBin
	}
	dir, err := os.MkdirTemp("", "kvipam-agent-bin-")
	require.NoError(t, err)
	bin := filepath.Join(dir, "kvipam-agent")
	out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput()
	require.NoError(t, err, string(out))
	agentBin = bin
	return bin
}

func TestMain(m *testing.M) {
	code := m.Run()
	if agentBin != "" {
		os.RemoveAll(filepath.Dir(agentBin))
	}
	cluster.RemoveBinaries()
	os.Exit(code)
}

func runAgent(t testing.TB, args, env []string) (string, int) {
	cmd := exec.Command(buildAgent(t), args...)
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.CombinedOutput()
	if ee, ok := err.(*exec.ExitError); ok {
		return string(out), ee.ExitCode()
	}
	require.NoError(t, err)
	return string(out), 0
}

// TestSIGKILLRestartKeepsEverything kills the agent process with SIGKILL,
// removes one pod's veth while it is down, and restarts it: every IP is
// kept, every endpoint is restored before any garbage collection, and only
// then is the vanished pod's IP released.
func TestSIGKILLRestartKeepsEverything(t *testing.T) {
	host := nstest.NewNS(t)
	h := nstest.Handle(t, host)
	e := etcdtest.Start(t)
	cli := etcdtest.Client(t, e)
	sockDir, err := os.MkdirTemp("", "kvipam-sock-")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(sockDir) })
	socket := filepath.Join(sockDir, "agent.sock")
	state := t.TempDir()
	// The agent runs in this namespace (to reach the test's etcd on
	// loopback) and manages the pod interfaces of the scratch one.
	args := []string{"--netns", host.Path(), "--node", "node-k", "--state-dir", state, "--socket", socket,
		"--etcd-endpoints", strings.Join(e.Endpoints(), ","), "--pool", "default=10.91.0.0/24,fd00:91::/64",
		"--block-size-v4", "28", "--datapath", "routes", "--metrics-addr", "", "--lease-ttl", "5s",
		"--gc-interval", "2s", "--gc-grace", "1s", "--mtu", "1500", "--routing", "none"}
	start := func() *exec.Cmd {
		cmd := exec.Command(buildAgent(t), args...)
		cmd.Stderr = &testLog{t: t}
		require.NoError(t, cmd.Start())
		t.Cleanup(func() { _ = cmd.Process.Kill(); _, _ = cmd.Process.Wait() })
		return cmd
	}
	c := client.New(socket, 5*time.Second)
	ctx := context.Background()
	waitUp := func() {
		wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		require.NoError(t, c.WaitReady(wctx))
	}

	agent := start()
	waitUp()
	const pods = 10
	held := map[string][]netip.Prefix{}
	for i := range pods {
		name := fmt.Sprintf("kvk%d", i)
		nstest.AddLink(t, h, name)
		o := api.Owner{ContainerID: fmt.Sprintf("pod-%d", i), IfName: "eth0"}
		r, err := c.Allocate(ctx, api.AllocateRequest{Owner: o})
		require.NoError(t, err)
		for _, ip := range r.IPs {
			held[o.ContainerID] = append(held[o.ContainerID], ip.Address)
		}
		_, err = c.CreateEndpoint(ctx, api.EndpointRequest{Owner: o, HostIfName: name})
		require.NoError(t, err)
	}
	before := allocations(t, cli)
	require.Len(t, before, 2*pods)

	require.NoError(t, agent.Process.Signal(syscall.SIGKILL))
	_, _ = agent.Process.Wait()
	gone, err := h.LinkByName("kvk0")
	require.NoError(t, err)
	require.NoError(t, h.LinkDel(gone))
	require.Equal(t, before, allocations(t, cli), "a killed agent leaves etcd as it was")

	start()
	waitUp()
	// The first answer already has every endpoint: restore ran before the
	// socket existed, and the reconciler's first pass is gc-interval away.
	eps, err := c.Endpoints(ctx)
	require.NoError(t, err)
	require.Len(t, eps, pods, "every endpoint restored before any GC")
	for i := range pods {
		o := api.Owner{ContainerID: fmt.Sprintf("pod-%d", i), IfName: "eth0"}
		r, err := c.Allocate(ctx, api.AllocateRequest{Owner: o})
		require.NoError(t, err)
		var got []netip.Prefix
		for _, ip := range r.IPs {
			got = append(got, ip.Address)
		}
		require.Equal(t, held[o.ContainerID], got, "pod %d kept its addresses", i)
		require.Equal(t, "allocated", r.State)
	}
	// The pod whose veth vanished is collected after the grace period:
	// await its release landing in etcd (the endpoint record goes at its
	// own moment, so a shorter endpoint list proves nothing about etcd),
	// then check that nothing else went.
	holdsPod0 := func(als map[string]string) bool {
		for k := range als {
			if strings.Contains(k, `"pod-0"`) {
				return true
			}
		}
		return false
	}
	require.True(t, holdsPod0(before), "the check below can see pod-0's records")
	require.Eventually(t, func() bool { return !holdsPod0(allocations(t, cli)) }, 60*time.Second, 50*time.Millisecond,
		"the vanished pod's addresses are released in etcd")
	require.Len(t, allocations(t, cli), 2*(pods-1), "only the vanished pod's addresses went")
	require.Eventually(t, func() bool {
		eps, err = c.Endpoints(ctx)
		return err == nil && len(eps) == pods-1
	}, 60*time.Second, 50*time.Millisecond, "and its endpoint record")
	for _, ep := range eps {
		require.NotEqual(t, "pod-0", ep.Owner.ContainerID)
	}
}

func allocations(t testing.TB, cli *clientv3.Client) map[string]string {
	t.Helper()
	resp, err := cli.Get(context.Background(), etcdstore.IPsPrefix("default"), clientv3.WithPrefix())
	require.NoError(t, err)
	out := map[string]string{}
	for _, kv := range resp.Kvs {
		out[string(kv.Key)+" "+string(kv.Value)] = fmt.Sprint(kv.ModRevision)
	}
	return out
}

// testLog sends the agent's log lines to the test log.
type testLog struct{ t testing.TB }

func (l *testLog) Write(p []byte) (int, error) {
	l.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// TestEmbeddedEtcdOnlyWhenAsked: the agent never runs an etcd of its own
// unless its configuration asks for one by name (invariant 9). Without
// endpoints and without embedded, or with the etcd section misspelt, it
// exits with status 2 naming both ways to say which etcd, having created
// no etcd data dir and served no socket; asked for by name, it runs the
// embedded etcd and says so in its status.
func TestEmbeddedEtcdOnlyWhenAsked(t *testing.T) {
	host := nstest.NewNS(t) // the agent manages pod interfaces there, never the host's
	agentIn := func(t *testing.T, extra ...string) (args []string, state, socket string) {
		sockDir, err := os.MkdirTemp("", "kvipam-sock-")
		require.NoError(t, err)
		t.Cleanup(func() { os.RemoveAll(sockDir) })
		state, socket = t.TempDir(), filepath.Join(sockDir, "agent.sock")
		args = append([]string{"--netns", host.Path(), "--node", "node-e", "--state-dir", state, "--socket", socket,
			"--pool", "default=10.94.0.0/24", "--block-size-v4", "28", "--datapath", "routes", "--metrics-addr", "",
			"--mtu", "1500", "--routing", "none"}, extra...)
		return args, state, socket
	}
	writeConfig := func(t *testing.T, body string) string {
		f := filepath.Join(t.TempDir(), "agent.yaml")
		require.NoError(t, os.WriteFile(f, []byte(body), 0o600))
		return f
	}
	// refused runs the agent and awaits the first of: its exit, or an
	// etcd data dir or socket appearing (then it started an etcd of its
	// own: the bug).
	refused := func(t *testing.T, args []string, env []string, state, socket string) string {
		cmd := exec.Command(buildAgent(t), args...)
		cmd.Env = append(os.Environ(), env...)
		var out strings.Builder
		cmd.Stdout, cmd.Stderr = &out, &out
		require.NoError(t, cmd.Start())
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		t.Cleanup(func() { _ = cmd.Process.Kill(); <-done })
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case err := <-done:
				done <- err // for the cleanup
				var ee *exec.ExitError
				require.ErrorAs(t, err, &ee, out.String())
				require.Equal(t, 2, ee.ExitCode(), out.String())
				require.NoDirExists(t, filepath.Join(state, "etcd"), "a refused configuration creates no etcd data")
				require.NoFileExists(t, socket)
				return out.String()
			case <-tick.C:
				for _, p := range []string{filepath.Join(state, "etcd"), socket} {
					if _, err := os.Stat(p); err == nil {
						t.Fatalf("the agent created %s: it runs an etcd of its own that nobody asked for\n%s", p, out.String())
					}
				}
			}
		}
	}

	t.Run("no endpoints and no embedded", func(t *testing.T) {
		args, state, socket := agentIn(t)
		out := refused(t, args, nil, state, socket)
		for _, want := range []string{"no endpoints", "--etcd-endpoints", "--etcd-embedded", "etcd.embedded: true"} {
			require.Contains(t, out, want)
		}
	})
	t.Run("misspelt endpoints", func(t *testing.T) {
		args, state, socket := agentIn(t, "--config", writeConfig(t, "etcd:\n  endpoint: [\"http://127.0.0.1:2379\"]\n"))
		out := refused(t, args, nil, state, socket)
		require.Contains(t, out, "etcd.endpoint: unknown key (did you mean endpoints?)")
	})
	t.Run("endpoints and embedded", func(t *testing.T) {
		args, state, socket := agentIn(t, "--etcd-endpoints", "http://127.0.0.1:2379")
		out := refused(t, args, []string{"KVIPAM_ETCD_EMBEDDED=true"}, state, socket)
		require.Contains(t, out, "both")
	})
	t.Run("embedded listen without embedded", func(t *testing.T) {
		args, state, socket := agentIn(t, "--etcd-endpoints", "http://127.0.0.1:2379", "--embedded-etcd-listen", "http://127.0.0.1:0")
		out := refused(t, args, nil, state, socket)
		require.Contains(t, out, "embedded-etcd-listen")
	})
	t.Run("asked for by name", func(t *testing.T) {
		args, state, socket := agentIn(t, "--config", writeConfig(t, "etcd: {embedded: true}\n"))
		cmd := exec.Command(buildAgent(t), args...)
		cmd.Stderr = &testLog{t: t}
		require.NoError(t, cmd.Start())
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		t.Cleanup(func() { _ = cmd.Process.Signal(syscall.SIGTERM); <-done })
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		go func() {
			select {
			case <-done:
				cancel() // it exited: stop waiting
			case <-ctx.Done():
			}
		}()
		c := client.New(socket, 5*time.Second)
		require.NoError(t, c.WaitReady(ctx))
		st, err := c.Status(context.Background())
		require.NoError(t, err)
		require.True(t, st.Etcd.Embedded, "the status says the etcd is the embedded one")
		require.DirExists(t, filepath.Join(state, "etcd"))
	})
}

// TestDuplicateNodeNameExits: an agent process started under the name of
// a running one, with other node addresses (a clone), exits with status 1
// and says why, naming both agents; the running one stays ready.
func TestDuplicateNodeNameExits(t *testing.T) {
	host := nstest.NewNS(t)
	e := etcdtest.Start(t)
	sockDir, err := os.MkdirTemp("", "kvipam-sock-")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(sockDir) })
	args := func(name, addr string) []string {
		return []string{"--netns", host.Path(), "--node", "node-d", "--node-address", addr,
			"--state-dir", filepath.Join(t.TempDir(), name), "--socket", filepath.Join(sockDir, name+".sock"),
			"--etcd-endpoints", strings.Join(e.Endpoints(), ","), "--pool", "default=10.92.0.0/24",
			"--block-size-v4", "28", "--datapath", "routes", "--metrics-addr", "", "--mtu", "1500", "--routing", "none"}
	}
	first := exec.Command(buildAgent(t), args("first", "192.0.2.1")...)
	first.Stderr = &testLog{t: t}
	require.NoError(t, first.Start())
	t.Cleanup(func() { _ = first.Process.Signal(syscall.SIGTERM); _, _ = first.Process.Wait() })
	c := client.New(filepath.Join(sockDir, "first.sock"), 5*time.Second)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, c.WaitReady(ctx))

	out, code := runAgent(t, args("second", "192.0.2.2"), nil)
	require.Equal(t, 1, code, out)
	for _, want := range []string{"refusing to start", `node name \"node-d\" is held by another agent`, "192.0.2.1", "192.0.2.2", "must be unique", "--node"} {
		require.Contains(t, out, want)
	}
	st, err := c.Status(ctx)
	require.NoError(t, err)
	require.True(t, st.Ready, st.Message)
}
