package k8s

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// The cluster's addresses: the router namespace holds a bridge, the
// control plane (etcd, kube-apiserver, kube-controller-manager,
// kube-scheduler) on its address, and each node's veth; nodes are on that
// one L2 segment, which host-gw routing needs.
const (
	routerIP  = "172.30.0.1"
	routerIP6 = "fd00:30::1"
	apiURL    = "https://" + routerIP + ":6443"
	etcdURL   = "https://" + routerIP + ":2379"
	// Images built here and imported on each node: nothing is pulled.
	pauseRef  = "kvipam.test/pause:1"
	ktRef     = "kvipam.test/kt:1"
	bridgeRef = "kvipam.test/cni-bridge:1"
)

// kcluster is a real Kubernetes: its processes, namespaces and scratch
// directory, all made by the test and removed by stop.
type kcluster struct {
	dir     string // scratch, removed at stop
	repo    string // the kvipam repository root
	kbin    string // kube-apiserver, ..., kubectl
	bin     string // etcd, kvipamctl, plugins, kt, ociwrite
	pki     string
	suffix  string
	router  string // netns name
	nodes   []*knode
	procs   []*kproc
	kubecfg string // admin's

	imageTar     string // make image's archive
	agentYAML    string // make image's rendered manifests
	uninstallYML string
	hostSysctls  map[string]string // the host's, before the cluster started
	installed    bool              // kvipam's DaemonSet applied
	adoptInstall bool              // applied without its conflist (installForAdoption)
	whereabouts  bool              // whereabouts' CRDs, RBAC and kubeconfigs installed
	etcdAuth     bool              // etcd's users and roles made, authentication on
	bridgeOn     bool              // the bridge DaemonSet applied
	bursts       int               // BenchmarkK8sBurst's bursts so far
	rounds       int               // and its rounds (odd ones backward)
	datapath     string            // the ConfigMap's datapath ("" is the manifest's: auto)
	noPortmap    bool              // the ConfigMap's conflist without portmap chained
}

type knode struct {
	name, netns, ip, ip6 string
	dir                  string
	cgroup               string // kubelet's cgroupRoot
	holder               *exec.Cmd
	socket               string // containerd's
	containerd           int    // its process ID
}

type kproc struct {
	name string
	cmd  *exec.Cmd
	log  *os.File
	done chan struct{}
}

var (
	clusterOnce sync.Once
	theCluster  *kcluster
	clusterErr  error
)

// logf is the fixture's log (it outlives any one test).
func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "k8s-e2e %s: %s\n", time.Now().UTC().Format("15:04:05.000"), fmt.Sprintf(format, args...))
}

func requireRoot(tb testing.TB) {
	tb.Helper()
	if os.Geteuid() != 0 {
		tb.Skip("needs root: the Kubernetes e2e tests create network and mount namespaces, cgroups, and run kubelet and containerd (make k8s-e2e as root)")
	}
	for _, b := range []string{"containerd", "ctr", "runc", "ip", "nsenter", "unshare", "mount"} {
		if _, err := exec.LookPath(b); err != nil {
			tb.Skipf("needs %s (Debian: apt-get install containerd runc iproute2 util-linux)", b)
		}
	}
}

// cluster starts the shared cluster on first use; TestMain stops it.
func cluster(tb testing.TB) *kcluster {
	tb.Helper()
	requireRoot(tb)
	clusterOnce.Do(func() {
		start := time.Now()
		theCluster, clusterErr = startCluster()
		logf("cluster up in %s (err %v)", time.Since(start).Round(time.Millisecond), clusterErr)
	})
	if clusterErr != nil {
		tb.Fatalf("start the cluster: %v", clusterErr)
	}
	return theCluster
}

func TestMain(m *testing.M) {
	code := m.Run()
	if theCluster != nil {
		theCluster.stop()
	}
	os.Exit(code)
}

func run(name string, args ...string) (string, error) {
	cmd := exec.Command(name, args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	if err != nil {
		return out.String(), fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, tail(out.String(), 3000))
	}
	return out.String(), nil
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

func startCluster() (c *kcluster, err error) {
	wd, err := os.Getwd()
	if err != nil {
		return nil, err
	}
	repo := filepath.Clean(filepath.Join(wd, "..", ".."))
	cleanStale()
	suffix := strconv.Itoa(os.Getpid())
	dir, err := os.MkdirTemp("", "kvipam-k8s-"+suffix+"-")
	if err != nil {
		return nil, err
	}
	c = &kcluster{dir: dir, repo: repo, suffix: suffix, pki: filepath.Join(dir, "pki"), bin: filepath.Join(dir, "bin")}
	c.router = "k8sr-" + c.suffix
	defer func() {
		if err != nil {
			c.stop()
		}
	}()
	c.hostSysctls = readSysctls()
	steps := []struct {
		name string
		f    func() error
	}{
		{"build", c.build},
		{"pki", c.makePKI},
		{"network", c.makeNetwork},
		{"control plane", c.startControlPlane},
		{"nodes", c.startNodes},
	}
	for _, s := range steps {
		t0 := time.Now()
		if err := s.f(); err != nil {
			return c, fmt.Errorf("%s: %w", s.name, err)
		}
		logf("%s: %s", s.name, time.Since(t0).Round(time.Millisecond))
	}
	return c, nil
}

// build makes every binary and image: the Kubernetes binaries from this
// module (cached by Go's build cache; make k8s-e2e builds them first into
// KVIPAM_K8S_BIN), kvipam's from the repository, and the images.
func (c *kcluster) build() error {
	c.kbin = os.Getenv("KVIPAM_K8S_BIN")
	if c.kbin == "" {
		c.kbin = filepath.Join(c.repo, ".cache", "k8s", "bin")
	}
	need := []string{"kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kubectl"}
	missing := false
	for _, b := range need {
		if _, err := os.Stat(filepath.Join(c.kbin, b)); err != nil {
			missing = true
		}
	}
	if missing {
		args := []string{"build", "-ldflags=-s -w", "-o", c.kbin + "/"}
		for _, b := range need {
			args = append(args, "k8s.io/kubernetes/cmd/"+b)
		}
		if _, err := run("go", args...); err != nil {
			return err
		}
	}
	if err := os.MkdirAll(c.bin, 0o755); err != nil {
		return err
	}
	// kvipam's module: etcd at kvipam's version, kvipamctl, the reference
	// plugins for the bridge baseline, the pause process, the image writer.
	args := []string{"-C", c.repo, "build", "-o", c.bin + "/",
		"github.com/kvipam/kvipam/e2e/cluster/etcd",
		"github.com/kvipam/kvipam/cmd/kvipamctl",
		"github.com/kvipam/kvipam/e2e/pause",
		"github.com/kvipam/kvipam/internal/tools/ociimage/ociwrite",
		"github.com/containernetworking/plugins/plugins/main/bridge",
		"github.com/containernetworking/plugins/plugins/main/loopback",
		"github.com/containernetworking/plugins/plugins/ipam/host-local",
		"github.com/containernetworking/plugins/plugins/meta/portmap",
	}
	cmd := exec.Command("go", args...)
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go %s: %w: %s", strings.Join(args, " "), err, out)
	}
	// The whereabouts plugin from its own module (whereabouts/go.mod pins
	// it; the adoption tests install it on the nodes).
	cmd = exec.Command("go", "-C", "whereabouts", "build", "-trimpath", "-ldflags=-s -w", "-o", filepath.Join(c.bin, "whereabouts"), whereaboutsPkg)
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build whereabouts: %w: %s", err, out)
	}
	cmd = exec.Command("go", "build", "-o", c.bin+"/", "./cmd/kt", "./cmd/etcdauth")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build kt etcdauth: %w: %s", err, out)
	}
	// kvipam's image and manifests, as docs/kubernetes.md says: make image
	// (one architecture here: the nodes are this machine).
	out := filepath.Join(c.dir, "image")
	if _, err := run("make", "-C", c.repo, "image", "BIN="+out, "IMAGE_ARCHS=amd64"); err != nil {
		return err
	}
	c.imageTar = filepath.Join(out, "kvipam-image.tar")
	c.agentYAML = filepath.Join(out, "kvipam-agent.yaml")
	c.uninstallYML = filepath.Join(out, "kvipam-uninstall.yaml")
	ow := filepath.Join(c.bin, "ociwrite")
	b := func(n string) string { return filepath.Join(c.bin, n) }
	if _, err := run(ow, "--out", filepath.Join(c.dir, "pause.tar"), "--ref", pauseRef, "--entrypoint", "/pause", "pause="+b("pause")); err != nil {
		return err
	}
	if _, err := run(ow, "--out", filepath.Join(c.dir, "kt.tar"), "--ref", ktRef, "--entrypoint", "/kt", "kt="+b("kt")); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(c.dir, "90-bridge.conflist"), []byte(bridgeConflist), 0o644); err != nil {
		return err
	}
	_, err := run(ow, "--out", filepath.Join(c.dir, "bridge.tar"), "--ref", bridgeRef, "--entrypoint", "/kt",
		"kt="+b("kt"), "cni/bridge="+b("bridge"), "cni/host-local="+b("host-local"), "cni/loopback="+b("loopback"),
		"cni/portmap="+b("portmap"), "cni/90-bridge.conflist="+filepath.Join(c.dir, "90-bridge.conflist"))
	return err
}

// bridgeConflist is the baseline of the burst figures: the reference
// bridge and host-local plugins, dual stack like kvipam's pools, chained
// with portmap as kvipam's conflist is (and as containerd's own bridge
// conflist, 10-containerd-net.conflist, is): both networks serve
// hostPorts, and a sandbox's CNI ADD runs the same chain but for the
// plugin compared.
const bridgeConflist = `{
  "cniVersion": "1.0.0",
  "name": "bridge",
  "plugins": [
    {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.250.0.0/16"}], [{"subnet": "fd00:250::/64"}]]}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
`

// --- processes ---

// spawn starts a long-running process (its output to DIR/logs/NAME.log),
// killed at stop.
func (c *kcluster) spawn(name string, args ...string) (*kproc, error) {
	if err := os.MkdirAll(filepath.Join(c.dir, "logs"), 0o755); err != nil {
		return nil, err
	}
	f, err := os.Create(filepath.Join(c.dir, "logs", name+".log"))
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
	if err := startOnLastingThread(cmd); err != nil {
		f.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &kproc{name: name, cmd: cmd, log: f, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(p.done) }()
	c.procs = append(c.procs, p)
	return p, nil
}

// spawner starts the cluster's processes from one OS thread that lives as
// long as the test process: Pdeathsig is sent when the *thread* that
// started a process ends, not the process, and Go ends a thread whose
// goroutine exits locked to it. A kubelet started from a test's goroutine
// died with no word in its log (SIGKILL) a minute after it was restarted,
// when some locked goroutine's thread ended (CI under two CPU hogs: every
// later pod on its node stayed Pending). The spawner's goroutine locks its
// thread once, at package start, before any namespace is entered, and
// never returns.
var spawner = func() chan spawnRequest {
	ch := make(chan spawnRequest)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread ends only with the process
		for r := range ch {
			r.err <- r.cmd.Start()
		}
	}()
	return ch
}()

type spawnRequest struct {
	cmd *exec.Cmd
	err chan error
}

// startOnLastingThread starts cmd from the spawner's thread.
func startOnLastingThread(cmd *exec.Cmd) error {
	r := spawnRequest{cmd: cmd, err: make(chan error, 1)}
	spawner <- r
	return <-r.err
}

func (p *kproc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// inRouter is argv run in the router's network namespace.
func (c *kcluster) inRouter(args ...string) []string {
	return append([]string{"nsenter", "--net=/run/netns/" + c.router, "--"}, args...)
}

// waitFor polls cond until it holds or limit passes.
func waitFor(limit time.Duration, what string, cond func() error) error {
	deadline := time.Now().Add(limit)
	var last error
	for time.Now().Before(deadline) {
		if last = cond(); last == nil {
			return nil
		}
		time.Sleep(250 * time.Millisecond)
	}
	return fmt.Errorf("%s not within %s: %w", what, limit, last)
}

func (c *kcluster) startControlPlane() error {
	p := func(n string) string { return filepath.Join(c.pki, n) }
	etcd, err := c.spawn("etcd", c.inRouter(filepath.Join(c.bin, "etcd"), "--name", "e0", "--data-dir", filepath.Join(c.dir, "etcd"),
		"--listen-client-urls", etcdURL, "--advertise-client-urls", etcdURL,
		"--listen-peer-urls", "http://127.0.0.1:2380", "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
		"--initial-cluster", "e0=http://127.0.0.1:2380", "--listen-metrics-urls", "http://127.0.0.1:2381",
		"--cert-file", p("etcd.crt"), "--key-file", p("etcd.key"), "--trusted-ca-file", p("ca.crt"), "--client-cert-auth",
		"--unsafe-no-fsync", "--log-level", "warn")...)
	if err != nil {
		return err
	}
	if err := waitFor(time.Minute, "etcd serving", func() error {
		if etcd.exited() {
			return errors.New("etcd exited: " + c.logTail("etcd"))
		}
		_, err := c.kvipamctl("node", "list")
		return err
	}); err != nil {
		return err
	}
	api, err := c.spawn("kube-apiserver", c.inRouter(filepath.Join(c.kbin, "kube-apiserver"),
		"--etcd-servers", etcdURL, "--etcd-cafile", p("ca.crt"), "--etcd-certfile", p("apiserver-etcd.crt"), "--etcd-keyfile", p("apiserver-etcd.key"),
		"--bind-address", routerIP, "--advertise-address", routerIP, "--secure-port", "6443",
		"--tls-cert-file", p("apiserver.crt"), "--tls-private-key-file", p("apiserver.key"), "--client-ca-file", p("ca.crt"),
		"--service-account-key-file", p("sa.pub"), "--service-account-signing-key-file", p("sa.key"),
		"--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
		"--service-cluster-ip-range", "10.96.0.0/16", "--authorization-mode", "Node,RBAC", "--enable-admission-plugins", "NodeRestriction",
		"--kubelet-client-certificate", p("apiserver-kubelet.crt"), "--kubelet-client-key", p("apiserver-kubelet.key"),
		"--kubelet-preferred-address-types", "InternalIP", "--allow-privileged=true", "--cert-dir", filepath.Join(c.dir, "apiserver-certs"),
		"--v", "1")...)
	if err != nil {
		return err
	}
	if err := waitFor(3*time.Minute, "kube-apiserver ready", func() error {
		if api.exited() {
			return errors.New("kube-apiserver exited: " + c.logTail("kube-apiserver"))
		}
		_, err := c.kubectl("get", "--raw", "/readyz")
		return err
	}); err != nil {
		return err
	}
	flex := filepath.Join(c.dir, "flex")
	if _, err := c.spawn("kube-controller-manager", c.inRouter(filepath.Join(c.kbin, "kube-controller-manager"),
		"--kubeconfig", p("controller-manager.kubeconfig"), "--authentication-kubeconfig", p("controller-manager.kubeconfig"),
		"--authorization-kubeconfig", p("controller-manager.kubeconfig"),
		"--use-service-account-credentials=true", "--service-account-private-key-file", p("sa.key"), "--root-ca-file", p("ca.crt"),
		"--leader-elect=false", "--bind-address", "127.0.0.1", "--cert-dir", filepath.Join(c.dir, "kcm-certs"),
		"--flex-volume-plugin-dir", flex,
		"--v", "1")...); err != nil {
		return err
	}
	if _, err := c.spawn("kube-scheduler", c.inRouter(filepath.Join(c.kbin, "kube-scheduler"),
		"--kubeconfig", p("scheduler.kubeconfig"), "--authentication-kubeconfig", p("scheduler.kubeconfig"),
		"--authorization-kubeconfig", p("scheduler.kubeconfig"),
		"--leader-elect=false", "--bind-address", "127.0.0.1", "--v", "1")...); err != nil {
		return err
	}
	// The controllers are working when the default namespace's service
	// account exists (the serviceaccount controller made it).
	return waitFor(3*time.Minute, "controller-manager (default service account)", func() error {
		_, err := c.kubectl("-n", "default", "get", "serviceaccount", "default")
		return err
	})
}

func (c *kcluster) logTail(name string) string {
	b, _ := os.ReadFile(filepath.Join(c.dir, "logs", name+".log"))
	return tail(string(b), 3000)
}

// kubectl runs kubectl as the cluster's admin (in the router's network
// namespace, where the API server listens).
func (c *kcluster) kubectl(args ...string) (string, error) {
	argv := c.inRouter(append([]string{filepath.Join(c.kbin, "kubectl"), "--kubeconfig", c.kubecfg, "--request-timeout", "60s"}, args...)...)
	cmd := exec.Command(argv[0], argv[1:]...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		return out.String(), fmt.Errorf("kubectl %s: %w: %s%s", strings.Join(args, " "), err, tail(out.String(), 2000), tail(errb.String(), 2000))
	}
	return out.String(), nil
}

// kubectlIn is kubectl with stdin.
func (c *kcluster) kubectlIn(stdin string, args ...string) (string, error) {
	argv := c.inRouter(append([]string{filepath.Join(c.kbin, "kubectl"), "--kubeconfig", c.kubecfg, "--request-timeout", "60s"}, args...)...)
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdin = strings.NewReader(stdin)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return out.String(), fmt.Errorf("kubectl %s: %w: %s", strings.Join(args, " "), err, tail(out.String(), 3000))
	}
	return out.String(), nil
}

// kvipamctl runs kvipamctl against the cluster's etcd with kvipam's
// client certificate.
func (c *kcluster) kvipamctl(args ...string) (string, error) {
	p := func(n string) string { return filepath.Join(c.pki, n) }
	argv := c.inRouter(append([]string{filepath.Join(c.bin, "kvipamctl"), "--endpoints", etcdURL,
		"--cacert", p("ca.crt"), "--cert", p("kvipam.crt"), "--key", p("kvipam.key"), "--timeout", "60s"}, args...)...)
	return run(argv[0], argv[1:]...)
}
