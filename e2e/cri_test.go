package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	cri "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/kvipam/kvipam/internal/tools/ociimage"
)

// pauseRef is the sandbox image the CRI tests build and import: no
// registry is reachable.
const pauseRef = "kvipam.test/pause:1"

// criRuntime is a private containerd with its CRI plugin, running in a
// node's namespace (so the plugins it runs program that namespace, never
// the host's), with its own root, state, socket and CNI directories.
type criRuntime struct {
	rt     cri.RuntimeServiceClient
	socket string
	pid    int // containerd's: its mount namespace holds the pods' netns mounts
}

func requireContainerd(t *testing.T) {
	t.Helper()
	for _, b := range []string{"containerd", "ctr", "runc"} {
		if _, err := exec.LookPath(b); err != nil {
			t.Skipf("needs %s (Debian: apt-get install containerd runc; .ci/run installs them)", b)
		}
	}
}

// startContainerd runs containerd for node n with conflist as its only
// network configuration, imports the sandbox image, and connects to its
// CRI service. It is killed at cleanup.
func startContainerd(t *testing.T, n *node, conflist string) *criRuntime {
	t.Helper()
	netd := filepath.Join(n.dir, "ctrd", "net.d")
	require.NoError(t, os.MkdirAll(netd, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(netd, "10-kvipam.conflist"), []byte(conflist), 0o644))
	return startContainerdDirs(t, n, n.bin, netd)
}

// startContainerdDirs is startContainerd with the CNI binary and
// configuration directories given (maybe empty, for an installer to fill).
func startContainerdDirs(t *testing.T, n *node, binDir, netd string) *criRuntime {
	t.Helper()
	dir := filepath.Join(n.dir, "ctrd")
	require.NoError(t, os.MkdirAll(dir, 0o755))
	require.NoError(t, os.MkdirAll(netd, 0o755))
	socket := filepath.Join(dir, "c.sock")
	conf := fmt.Sprintf(`version = 2
root = %q
state = %q
[grpc]
  address = %q
[ttrpc]
  address = %q
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %q
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  disable_apparmor = true
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = ""
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "native"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        Root = %q
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = %q
    conf_dir = %q
    max_conf_num = 1
`, filepath.Join(dir, "root"), filepath.Join(dir, "state"), socket, socket+".ttrpc", pauseRef, filepath.Join(dir, "runc"), binDir, netd)
	confPath := filepath.Join(dir, "config.toml")
	require.NoError(t, os.WriteFile(confPath, []byte(conf), 0o644))
	logf, err := os.Create(filepath.Join(dir, "containerd.log"))
	require.NoError(t, err)
	// containerd keeps the CNI result cache in /var/lib/cni and the shim
	// sockets in /run/containerd, whatever its configuration says: it runs
	// in a private mount namespace with scratch directories mounted there.
	cniCache, shims := filepath.Join(dir, "cni-cache"), filepath.Join(dir, "run")
	for _, d := range []string{cniCache, shims, "/var/lib/cni", "/run/containerd"} {
		require.NoError(t, os.MkdirAll(d, 0o755))
	}
	cmd := exec.Command("unshare", "--mount", "--propagation", "private", "sh", "-c",
		`mount --bind "$1" /var/lib/cni && mount --bind "$2" /run/containerd && exec containerd --config "$3"`,
		"sh", cniCache, shims, confPath)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	require.NoError(t, startIn(n.host, cmd))
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(15 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
		killShims(t, socket)
		logf.Close()
		if t.Failed() {
			b, _ := os.ReadFile(logf.Name())
			t.Logf("containerd log:\n%s", tailString(string(b), 6000))
		}
	})
	waitFor(t, 30*time.Second, "containerd's socket", func() bool { _, err := os.Stat(socket); return err == nil })

	// The sandbox image: a pause process, built here.
	pause := filepath.Join(dir, "pause")
	out, err := exec.Command("go", "build", "-o", pause, "github.com/kvipam/kvipam/e2e/pause").CombinedOutput()
	require.NoError(t, err, "%s", out)
	data, err := os.ReadFile(pause)
	require.NoError(t, err)
	archive := filepath.Join(dir, "pause.tar")
	_, err = ociimage.Write(ociimage.Spec{Ref: pauseRef, Entrypoint: []string{"/pause"},
		Files: []ociimage.File{{Path: "pause", Data: data, Mode: 0o755}}}, archive)
	require.NoError(t, err)
	out, err = exec.Command("ctr", "--address", socket, "-n", "k8s.io", "images", "import", "--all-platforms", archive).CombinedOutput()
	require.NoError(t, err, "ctr images import: %s", out)

	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	rt := cri.NewRuntimeServiceClient(conn)
	// Sandboxes a test leaves are stopped and removed while containerd
	// still runs: their shims outlive containerd otherwise.
	t.Cleanup(func() { removeSandboxes(t, rt) })
	return &criRuntime{rt: rt, socket: socket, pid: cmd.Process.Pid}
}

// removeSandboxes stops and removes every sandbox of a test's containerd,
// as kubelet does for pods that are gone.
func removeSandboxes(t *testing.T, rt cri.RuntimeServiceClient) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	list, err := rt.ListPodSandbox(ctx, &cri.ListPodSandboxRequest{})
	if err != nil {
		t.Logf("list sandboxes to remove: %v", err)
		return
	}
	for _, sb := range list.Items {
		if _, err := rt.StopPodSandbox(ctx, &cri.StopPodSandboxRequest{PodSandboxId: sb.Id}); err != nil {
			t.Logf("stop sandbox %s: %v", sb.Id, err)
		}
		if _, err := rt.RemovePodSandbox(ctx, &cri.RemovePodSandboxRequest{PodSandboxId: sb.Id}); err != nil {
			t.Logf("remove sandbox %s: %v", sb.Id, err)
		}
	}
}

// killShims kills what is left of the shims of the containerd at socket
// once it has stopped (a sandbox it could not remove): each shim names
// its containerd's address on its command line.
func killShims(t *testing.T, socket string) {
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, f := range procs {
		b, err := os.ReadFile(f)
		if err != nil || !bytes.Contains(b, []byte("containerd-shim")) || !bytes.Contains(b, []byte("\x00"+socket+"\x00")) {
			continue
		}
		pid, err := strconv.Atoi(filepath.Base(filepath.Dir(f)))
		if err == nil {
			t.Logf("killing containerd shim %d left by %s", pid, socket)
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
}

func tailString(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

// criPod is a sandbox's configuration as kubelet sends it.
func criPod(name, namespace, uid string, annotations map[string]string) *cri.PodSandboxConfig {
	return &cri.PodSandboxConfig{
		Metadata:    &cri.PodSandboxMetadata{Name: name, Namespace: namespace, Uid: uid},
		Hostname:    name,
		Annotations: annotations,
		Linux:       &cri.LinuxPodSandboxConfig{},
	}
}

// sandboxNetns is the path of a sandbox's network namespace, from the
// verbose status (containerd's runtime spec).
func sandboxNetns(t *testing.T, ctx context.Context, rt cri.RuntimeServiceClient, id string) string {
	t.Helper()
	st, err := rt.PodSandboxStatus(ctx, &cri.PodSandboxStatusRequest{PodSandboxId: id, Verbose: true})
	require.NoError(t, err)
	var info struct {
		RuntimeSpec struct {
			Linux struct {
				Namespaces []struct{ Type, Path string } `json:"namespaces"`
			} `json:"linux"`
		} `json:"runtimeSpec"`
	}
	require.NoError(t, json.Unmarshal([]byte(st.Info["info"]), &info))
	for _, n := range info.RuntimeSpec.Linux.Namespaces {
		if n.Type == "network" {
			return n.Path
		}
	}
	t.Fatalf("no network namespace in %s's status", id)
	return ""
}

// TestCRIPodLifecycle drives a private containerd's CRI as kubelet does:
// three pods get addresses (PodSandboxStatus), etcd's owner record holds
// each pod's namespace, name and UID, the pods reach each other, and
// StopPodSandbox (twice) and RemovePodSandbox release every address and
// remove every host interface.
func TestCRIPodLifecycle(t *testing.T) {
	requireContainerd(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	n := newNode(t, "cri")
	n.startAgent(agentOpts{pools: []string{"default=10.12.0.0/16"}})
	conflist := fmt.Sprintf(`{"cniVersion":"1.0.0","name":"kvipam","plugins":[{"type":"kvipam","agentSocket":%q,"delQueueDir":%q,"agentTimeout":"10s","capabilities":{"io.kubernetes.cri.pod-annotations":true}}]}`,
		n.socket, n.queue)
	c := startContainerd(t, n, conflist)

	type sandbox struct{ id, name, uid, ip, netns string }
	var pods []sandbox
	for i := range 3 {
		p := sandbox{name: fmt.Sprintf("web-%d", i), uid: podUID(fmt.Sprintf("cri-%d", i))}
		r, err := c.rt.RunPodSandbox(ctx, &cri.RunPodSandboxRequest{Config: criPod(p.name, "shop", p.uid, nil)})
		require.NoError(t, err)
		p.id = r.PodSandboxId
		st, err := c.rt.PodSandboxStatus(ctx, &cri.PodSandboxStatusRequest{PodSandboxId: p.id})
		require.NoError(t, err)
		p.ip = st.Status.Network.Ip
		require.NotEmpty(t, p.ip, "PodSandboxStatus shows the pod's IP")
		// The netns is mounted in containerd's private mount namespace:
		// reach it through containerd's root.
		p.netns = fmt.Sprintf("/proc/%d/root%s", c.pid, sandboxNetns(t, ctx, c.rt, p.id))
		keys := n.ipKeys(p.id)
		require.NotEmpty(t, keys, "an allocation for sandbox %s", p.id)
		for _, v := range keys {
			require.Contains(t, v, `"namespace":"shop"`)
			require.Contains(t, v, `"pod":"`+p.name+`"`)
			require.Contains(t, v, `"podUID":"`+p.uid+`"`)
		}
		pods = append(pods, p)
	}
	for _, from := range pods {
		fromNS, err := ns.GetNS(from.netns)
		require.NoError(t, err)
		for _, to := range pods {
			if to.id != from.id {
				require.NoError(t, ping(fromNS, mustAddr(t, to.ip)), "%s -> %s", from.name, to.ip)
			}
		}
		fromNS.Close()
	}

	h := nlHandle(t, n.host)
	for _, p := range pods {
		for range 2 { // kubelet stops a sandbox more than once
			_, err := c.rt.StopPodSandbox(ctx, &cri.StopPodSandboxRequest{PodSandboxId: p.id})
			require.NoError(t, err)
		}
		_, err := c.rt.RemovePodSandbox(ctx, &cri.RemovePodSandboxRequest{PodSandboxId: p.id})
		require.NoError(t, err)
		require.Empty(t, n.ipKeys(p.id), "%s's address released", p.name)
	}
	links, err := h.LinkList()
	require.NoError(t, err)
	for _, l := range links {
		require.False(t, strings.HasPrefix(l.Attrs().Name, "kv"), "host interface %s left behind", l.Attrs().Name)
	}
}

func mustAddr(t *testing.T, s string) netip.Addr {
	t.Helper()
	a, err := netip.ParseAddr(s)
	require.NoError(t, err)
	return a
}

// TestCRIPoolAnnotation: through containerd's CRI, pods annotated
// kvipam.io/pool: blue get addresses in blue, pods of a namespace bound to
// green (kvipamctl pool bind-namespace) get green, the others the default
// pool; a pod annotated with an unknown pool fails RunPodSandbox with the
// CNI error in its message and leaves no allocation, host interface or
// CNI cache entry.
func TestCRIPoolAnnotation(t *testing.T) {
	requireContainerd(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	n := newNode(t, "cra")
	n.startAgent(agentOpts{pools: []string{"default=10.13.0.0/16", "blue=10.14.0.0/16", "green=10.15.0.0/16"}})
	ctl := exec.Command(filepath.Join(n.bin, "kvipamctl"), "pool", "bind-namespace", "payments", "green", "--endpoints", n.etcdEndpoint())
	require.NoError(t, n.do(func() error {
		out, err := ctl.CombinedOutput()
		if err != nil {
			return fmt.Errorf("%w: %s", err, out)
		}
		return nil
	}))
	conflist := fmt.Sprintf(`{"cniVersion":"1.0.0","name":"kvipam","plugins":[{"type":"kvipam","agentSocket":%q,"delQueueDir":%q,"agentTimeout":"10s","capabilities":{"io.kubernetes.cri.pod-annotations":true}}]}`,
		n.socket, n.queue)
	c := startContainerd(t, n, conflist)

	run := func(name, namespace string, ann map[string]string) (string, error) {
		r, err := c.rt.RunPodSandbox(ctx, &cri.RunPodSandboxRequest{Config: criPod(name, namespace, podUID(name), ann)})
		if err != nil {
			return "", err
		}
		st, err := c.rt.PodSandboxStatus(ctx, &cri.PodSandboxStatusRequest{PodSandboxId: r.PodSandboxId})
		require.NoError(t, err)
		return st.Status.Network.Ip, nil
	}
	in := func(ip, cidr string) bool { return netip.MustParsePrefix(cidr).Contains(mustAddr(t, ip)) }
	// The agent learns the binding by a watch: the first pod may come
	// before it; retry on a fresh name until the binding applies.
	var ip string
	waitFor(t, 10*time.Second, "the namespace binding to reach the agent", func() bool {
		var err error
		ip, err = run(fmt.Sprintf("ledger-%d", time.Now().UnixNano()%1e6), "payments", nil)
		require.NoError(t, err)
		return in(ip, "10.15.0.0/16")
	})
	ip, err := run("blue-0", "web", map[string]string{"kvipam.io/pool": "blue"})
	require.NoError(t, err)
	require.True(t, in(ip, "10.14.0.0/16"), "annotated blue: %s", ip)
	ip, err = run("blue-1", "payments", map[string]string{"kvipam.io/pool": "blue"})
	require.NoError(t, err)
	require.True(t, in(ip, "10.14.0.0/16"), "the pod's annotation comes before its namespace's binding: %s", ip)
	ip, err = run("plain-0", "web", nil)
	require.NoError(t, err)
	require.True(t, in(ip, "10.13.0.0/16"), "the default pool: %s", ip)

	allocated := len(n.ipKeys(""))
	links := func() int {
		ls, err := nlHandle(t, n.host).LinkList()
		require.NoError(t, err)
		k := 0
		for _, l := range ls {
			if strings.HasPrefix(l.Attrs().Name, "kv") {
				k++
			}
		}
		return k
	}
	cached := func() int {
		entries, _ := os.ReadDir(filepath.Join(n.dir, "ctrd", "cni-cache", "results"))
		return len(entries)
	}
	hostIfs, cache := links(), cached()
	require.NotZero(t, cache, "containerd caches the results of the running pods")
	require.NotZero(t, hostIfs)
	_, err = run("lost-0", "web", map[string]string{"kvipam.io/pool": "nope"})
	require.Error(t, err)
	require.Contains(t, err.Error(), `pool "nope" (from the pod's annotation kvipam.io/pool)`, "the CNI error reaches RunPodSandbox")
	require.Contains(t, err.Error(), "web/lost-0")
	require.Equal(t, allocated, len(n.ipKeys("")), "no allocation or reservation left")
	require.Equal(t, hostIfs, links(), "no host interface left")
	require.Equal(t, cache, cached(), "no CNI cache entry left")
}

// TestCRIStickyAnnotation: through containerd's CRI, a pod annotated
// kvipam.io/sticky is stopped and removed, then re-created with the same
// name and a new UID: it gets the same address. Meanwhile other pods take
// every other address, and not that one.
func TestCRIStickyAnnotation(t *testing.T) {
	requireContainerd(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	n := newNode(t, "crs")
	n.startAgent(agentOpts{pools: []string{"default=10.16.0.0/28"}, blockV4: 28, reuseAtOnce: true})
	conflist := fmt.Sprintf(`{"cniVersion":"1.0.0","name":"kvipam","plugins":[{"type":"kvipam","agentSocket":%q,"delQueueDir":%q,"agentTimeout":"10s","capabilities":{"io.kubernetes.cri.pod-annotations":true}}]}`,
		n.socket, n.queue)
	c := startContainerd(t, n, conflist)
	run := func(name, uid string, ann map[string]string) (string, string) {
		r, err := c.rt.RunPodSandbox(ctx, &cri.RunPodSandboxRequest{Config: criPod(name, "db", uid, ann)})
		require.NoError(t, err)
		st, err := c.rt.PodSandboxStatus(ctx, &cri.PodSandboxStatusRequest{PodSandboxId: r.PodSandboxId})
		require.NoError(t, err)
		return r.PodSandboxId, st.Status.Network.Ip
	}
	remove := func(id string) {
		_, err := c.rt.StopPodSandbox(ctx, &cri.StopPodSandboxRequest{PodSandboxId: id})
		require.NoError(t, err)
		_, err = c.rt.RemovePodSandbox(ctx, &cri.RemovePodSandboxRequest{PodSandboxId: id})
		require.NoError(t, err)
	}
	sticky := map[string]string{"kvipam.io/sticky": "10m"}
	id, ip := run("pg-0", podUID("pg-0-a"), sticky)
	remove(id)
	// Other pods take every other address of the /28 (14 usable); none
	// gets pg-0's, and one more finds the pool exhausted.
	var others []string
	for i := range 13 {
		oid, oip := run(fmt.Sprintf("other-%d", i), podUID(fmt.Sprintf("other-%d", i)), nil)
		require.NotEqual(t, ip, oip, "a kept address went to another pod")
		others = append(others, oid)
	}
	_, err := c.rt.RunPodSandbox(ctx, &cri.RunPodSandboxRequest{Config: criPod("other-13", "db", podUID("other-13"), nil)})
	require.Error(t, err)
	require.Contains(t, err.Error(), "exhausted")
	id2, ip2 := run("pg-0", podUID("pg-0-b"), sticky)
	require.Equal(t, ip, ip2, "the re-created pod (new UID) gets its address back")
	remove(id2)
	for _, oid := range others {
		remove(oid)
	}
}
