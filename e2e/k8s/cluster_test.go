package k8s

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
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
	installed    bool // kvipam's DaemonSet applied
	bridgeOn     bool // the bridge DaemonSet applied
}

type knode struct {
	name, netns, ip, ip6 string
	dir                  string
	cgroup               string // kubelet's cgroupRoot
	holder               *exec.Cmd
	socket               string // containerd's
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
	dir, err := os.MkdirTemp("", "kvipam-k8s-")
	if err != nil {
		return nil, err
	}
	c = &kcluster{dir: dir, repo: repo, suffix: strconv.Itoa(os.Getpid() % 100000), pki: filepath.Join(dir, "pki"), bin: filepath.Join(dir, "bin")}
	c.router = "k8sr-" + c.suffix
	defer func() {
		if err != nil {
			c.stop()
		}
	}()
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
		"github.com/kvipam/kvipam/e2e/ociwrite",
		"github.com/containernetworking/plugins/plugins/main/bridge",
		"github.com/containernetworking/plugins/plugins/main/loopback",
		"github.com/containernetworking/plugins/plugins/ipam/host-local",
	}
	cmd := exec.Command("go", args...)
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go %s: %w: %s", strings.Join(args, " "), err, out)
	}
	cmd = exec.Command("go", "build", "-o", filepath.Join(c.bin, "kt"), "./cmd/kt")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build kt: %w: %s", err, out)
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
		"cni/90-bridge.conflist="+filepath.Join(c.dir, "90-bridge.conflist"))
	return err
}

// bridgeConflist is the baseline of the burst figures: the reference
// bridge and host-local plugins, dual stack like kvipam's pools.
const bridgeConflist = `{
  "cniVersion": "1.0.0",
  "name": "bridge",
  "plugins": [
    {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.250.0.0/16"}], [{"subnet": "fd00:250::/64"}]]}}
  ]
}
`

// --- certificates (Go crypto: one CA, every component's pair) ---

type certSpec struct {
	name   string
	cn     string
	orgs   []string
	ips    []string
	dns    []string
	server bool
	client bool
}

func (c *kcluster) makePKI() error {
	if err := os.MkdirAll(c.pki, 0o700); err != nil {
		return err
	}
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "kvipam-k8s-ca"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour), IsCA: true,
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature, BasicConstraintsValid: true}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return err
	}
	caCert, err := x509.ParseCertificate(caDER)
	if err != nil {
		return err
	}
	if err := writePEM(filepath.Join(c.pki, "ca.crt"), "CERTIFICATE", caDER); err != nil {
		return err
	}
	specs := []certSpec{
		{name: "etcd", cn: "etcd", ips: []string{routerIP, "127.0.0.1"}, server: true, client: true},
		{name: "kvipam", cn: "kvipam", client: true},
		{name: "apiserver-etcd", cn: "kube-apiserver-etcd-client", client: true},
		{name: "apiserver", cn: "kube-apiserver", ips: []string{routerIP, "10.96.0.1", "127.0.0.1"},
			dns: []string{"kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"}, server: true},
		{name: "apiserver-kubelet", cn: "kube-apiserver-kubelet-client", orgs: []string{"system:masters"}, client: true},
		{name: "admin", cn: "kubernetes-admin", orgs: []string{"system:masters"}, client: true},
		{name: "controller-manager", cn: "system:kube-controller-manager", client: true},
		{name: "scheduler", cn: "system:kube-scheduler", client: true},
		{name: "kubelet-n1", cn: "system:node:n1", orgs: []string{"system:nodes"}, client: true},
		{name: "kubelet-n2", cn: "system:node:n2", orgs: []string{"system:nodes"}, client: true},
	}
	for i, s := range specs {
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			return err
		}
		tmpl := &x509.Certificate{SerialNumber: big.NewInt(int64(i + 2)), Subject: pkix.Name{CommonName: s.cn, Organization: s.orgs},
			NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
			KeyUsage: x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment, DNSNames: s.dns}
		for _, ip := range s.ips {
			tmpl.IPAddresses = append(tmpl.IPAddresses, net.ParseIP(ip))
		}
		if s.server {
			tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageServerAuth)
		}
		if s.client {
			tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageClientAuth)
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &key.PublicKey, caKey)
		if err != nil {
			return err
		}
		if err := writePEM(filepath.Join(c.pki, s.name+".crt"), "CERTIFICATE", der); err != nil {
			return err
		}
		kder, err := x509.MarshalECPrivateKey(key)
		if err != nil {
			return err
		}
		if err := writePEM(filepath.Join(c.pki, s.name+".key"), "EC PRIVATE KEY", kder); err != nil {
			return err
		}
	}
	// The service accounts' signing pair.
	sa, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	kder, err := x509.MarshalECPrivateKey(sa)
	if err != nil {
		return err
	}
	if err := writePEM(filepath.Join(c.pki, "sa.key"), "EC PRIVATE KEY", kder); err != nil {
		return err
	}
	pder, err := x509.MarshalPKIXPublicKey(&sa.PublicKey)
	if err != nil {
		return err
	}
	if err := writePEM(filepath.Join(c.pki, "sa.pub"), "PUBLIC KEY", pder); err != nil {
		return err
	}
	// Kubeconfigs.
	for _, who := range []string{"admin", "controller-manager", "scheduler", "kubelet-n1", "kubelet-n2"} {
		kc := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: k
  cluster: {server: %q, certificate-authority: %q}
users:
- name: u
  user: {client-certificate: %q, client-key: %q}
contexts:
- name: k
  context: {cluster: k, user: u}
current-context: k
`, apiURL, filepath.Join(c.pki, "ca.crt"), filepath.Join(c.pki, who+".crt"), filepath.Join(c.pki, who+".key"))
		if err := os.WriteFile(filepath.Join(c.pki, who+".kubeconfig"), []byte(kc), 0o600); err != nil {
			return err
		}
	}
	c.kubecfg = filepath.Join(c.pki, "admin.kubeconfig")
	return nil
}

func writePEM(path, typ string, der []byte) error {
	return os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600)
}

// --- network: a router namespace with a bridge, a namespace per node ---

func (c *kcluster) makeNetwork() error {
	ipn := func(ns string, args ...string) error {
		_, err := run("ip", append([]string{"-n", ns}, args...)...)
		return err
	}
	if _, err := run("ip", "netns", "add", c.router); err != nil {
		return err
	}
	for _, a := range [][]string{
		{"link", "set", "lo", "up"},
		{"link", "add", "br0", "type", "bridge"},
		{"addr", "add", routerIP + "/24", "dev", "br0"},
		{"addr", "add", routerIP6 + "/64", "dev", "br0", "nodad"},
		{"link", "set", "br0", "up"},
	} {
		if err := ipn(c.router, a...); err != nil {
			return err
		}
	}
	for i, name := range []string{"n1", "n2"} {
		n := &knode{name: name, netns: "k8s" + name + "-" + c.suffix, ip: fmt.Sprintf("172.30.0.%d", 11+i),
			ip6: fmt.Sprintf("fd00:30::%d", 11+i), dir: filepath.Join(c.dir, name), cgroup: "/kvipam-k8s-" + c.suffix + "-" + name}
		c.nodes = append(c.nodes, n)
		if _, err := run("ip", "netns", "add", n.netns); err != nil {
			return err
		}
		peer := "v" + name
		for _, a := range [][]string{
			{"link", "add", "eth0", "type", "veth", "peer", "name", peer},
			{"link", "set", peer, "netns", c.router},
		} {
			if err := ipn(n.netns, a...); err != nil {
				return err
			}
		}
		for _, a := range [][]string{{"link", "set", peer, "master", "br0"}, {"link", "set", peer, "up"}} {
			if err := ipn(c.router, a...); err != nil {
				return err
			}
		}
		for _, a := range [][]string{
			{"link", "set", "lo", "up"},
			{"addr", "add", n.ip + "/24", "dev", "eth0"},
			{"addr", "add", n.ip6 + "/64", "dev", "eth0", "nodad"},
			{"link", "set", "eth0", "up"},
			{"route", "add", "default", "via", routerIP},
			{"-6", "route", "add", "default", "via", routerIP6},
		} {
			if err := ipn(n.netns, a...); err != nil {
				return err
			}
		}
		// A node forwards for its pods (its own namespace's sysctls).
		for _, kv := range []string{"net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1"} {
			if _, err := run("ip", "netns", "exec", n.netns, "sysctl", "-qw", kv); err != nil {
				return err
			}
		}
	}
	return nil
}

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
	if err := cmd.Start(); err != nil {
		f.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &kproc{name: name, cmd: cmd, log: f, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(p.done) }()
	c.procs = append(c.procs, p)
	return p, nil
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
		"--flex-volume-plugin-dir", flex, "--controllers", "*,-nodeipam,-service-lb-controller,-route,-cloud-node-lifecycle",
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

// --- nodes: a network namespace, a mount namespace, containerd, kubelet ---

// nodeSetup runs in the node's new mount namespace (private from the
// host's): scratch overlays over /etc, /opt, /var/lib and /var/log (so
// /etc/cni, /opt/cni/bin, /var/lib/kubelet, /var/lib/cni, /var/lib/kvipam
// and /var/log/pods are the node's own), a tmpfs over /run, a bpffs of its
// own, scratch files over the six sysctls kubelet writes, and everything
// made shared within this namespace (mount propagation for pods).
const nodeSetup = `set -e
D="$1"
mount -t tmpfs tmpfs "$D/ovl"
for p in etc opt var/lib var/log; do
  mkdir -p "$D/ovl/u/$p" "$D/ovl/w/$p"
  mount -t overlay overlay -o "lowerdir=/$p,upperdir=$D/ovl/u/$p,workdir=$D/ovl/w/$p" "/$p"
done
mount -t tmpfs tmpfs /run
mkdir -p /run/containerd /run/kvipam /etc/cni/net.d /opt/cni/bin
mount -t bpf bpf /sys/fs/bpf
for f in vm/overcommit_memory vm/panic_on_oom kernel/panic kernel/panic_on_oops kernel/keys/root_maxkeys kernel/keys/root_maxbytes; do
  s="$D/sysctl/$(echo $f | tr / .)"
  cat "/proc/sys/$f" > "$s"
  mount --bind "$s" "/proc/sys/$f"
done
mount --make-rshared /
echo ready > "$D/holder.ready"
exec sleep infinity
`

func (c *kcluster) startNodes() error {
	for _, n := range c.nodes {
		if err := c.startNode(n); err != nil {
			return fmt.Errorf("node %s: %w", n.name, err)
		}
	}
	// Registered (NotReady until a network is installed: no conflist).
	return waitFor(3*time.Minute, "both nodes registered", func() error {
		out, err := c.kubectl("get", "nodes", "-o", "name")
		if err != nil {
			return err
		}
		if !strings.Contains(out, "node/n1") || !strings.Contains(out, "node/n2") {
			return fmt.Errorf("nodes: %q", out)
		}
		return nil
	})
}

func (c *kcluster) inNode(n *knode, args ...string) []string {
	return append([]string{"nsenter", "-t", strconv.Itoa(n.holder.Process.Pid), "-m", "-n", "--"}, args...)
}

func (c *kcluster) startNode(n *knode) error {
	for _, d := range []string{"ovl", "sysctl", "ctrd", "kubelet"} {
		if err := os.MkdirAll(filepath.Join(n.dir, d), 0o755); err != nil {
			return err
		}
	}
	holder, err := c.spawn(n.name+"-holder", "nsenter", "--net=/run/netns/"+n.netns, "--", "unshare", "--mount", "--propagation", "private",
		"sh", "-c", nodeSetup, "sh", n.dir)
	if err != nil {
		return err
	}
	n.holder = holder.cmd
	if err := waitFor(time.Minute, "node namespace set up", func() error {
		if holder.exited() {
			return errors.New("setup failed: " + c.logTail(n.name+"-holder"))
		}
		_, err := os.Stat(filepath.Join(n.dir, "holder.ready"))
		return err
	}); err != nil {
		return err
	}
	// kubelet's cgroup root, in every hierarchy (removed at stop).
	if err := makeCgroups(n.cgroup); err != nil {
		return err
	}
	// containerd with its CRI (e2e/cri_test.go's configuration), the
	// node's own /etc/cni/net.d and /opt/cni/bin.
	dir := filepath.Join(n.dir, "ctrd")
	n.socket = filepath.Join(dir, "c.sock")
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
    bin_dir = "/opt/cni/bin"
    conf_dir = "/etc/cni/net.d"
    max_conf_num = 1
`, filepath.Join(dir, "root"), filepath.Join(dir, "state"), n.socket, n.socket+".ttrpc", pauseRef, filepath.Join(dir, "runc"))
	confPath := filepath.Join(dir, "config.toml")
	if err := os.WriteFile(confPath, []byte(conf), 0o644); err != nil {
		return err
	}
	ctrd, err := c.spawn(n.name+"-containerd", c.inNode(n, "containerd", "--config", confPath)...)
	if err != nil {
		return err
	}
	if err := waitFor(time.Minute, "containerd's socket", func() error {
		if ctrd.exited() {
			return errors.New("containerd exited: " + c.logTail(n.name+"-containerd"))
		}
		_, err := os.Stat(n.socket)
		return err
	}); err != nil {
		return err
	}
	for _, img := range []string{filepath.Join(c.dir, "pause.tar"), filepath.Join(c.dir, "kt.tar"), filepath.Join(c.dir, "bridge.tar"), c.imageTar} {
		if _, err := run("ctr", "--address", n.socket, "-n", "k8s.io", "images", "import", "--all-platforms", img); err != nil {
			return err
		}
	}
	// kubelet.
	kdir := filepath.Join(n.dir, "kubelet")
	resolv := filepath.Join(kdir, "resolv.conf")
	if err := os.WriteFile(resolv, []byte("nameserver 127.0.0.1\n"), 0o644); err != nil {
		return err
	}
	kconf := fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: %q
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: %q}
authorization: {mode: AlwaysAllow}
cgroupDriver: cgroupfs
cgroupRoot: %q
cgroupsPerQOS: true
failSwapOn: false
containerRuntimeEndpoint: %q
resolvConf: %q
volumePluginDir: %q
evictionHard: {"memory.available": "1Mi", "nodefs.available": "1%%", "imagefs.available": "1%%", "nodefs.inodesFree": "1%%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
registerNode: true
clusterDomain: cluster.local
maxPods: 110
`, n.ip, filepath.Join(c.pki, "ca.crt"), n.cgroup, "unix://"+n.socket, resolv, filepath.Join(kdir, "volume-plugins"))
	kconfPath := filepath.Join(kdir, "config.yaml")
	if err := os.WriteFile(kconfPath, []byte(kconf), 0o644); err != nil {
		return err
	}
	_, err = c.spawn(n.name+"-kubelet", c.inNode(n, filepath.Join(c.kbin, "kubelet"), "--config", kconfPath,
		"--kubeconfig", filepath.Join(c.pki, "kubelet-"+n.name+".kubeconfig"), "--hostname-override", n.name,
		"--node-ip", n.ip, "--v", "1")...)
	return err
}

// cgroupDirs are the hierarchies a cgroup root is made in (cgroup v1
// controllers, the named systemd one, and the unified one).
func cgroupDirs() []string {
	ents, _ := os.ReadDir("/sys/fs/cgroup")
	var dirs []string
	for _, e := range ents {
		if e.IsDir() && e.Type()&os.ModeSymlink == 0 {
			dirs = append(dirs, filepath.Join("/sys/fs/cgroup", e.Name()))
		}
	}
	if len(dirs) == 0 {
		dirs = []string{"/sys/fs/cgroup"}
	}
	return dirs
}

func makeCgroups(root string) error {
	for _, d := range cgroupDirs() {
		p := filepath.Join(d, root)
		if err := os.MkdirAll(p, 0o755); err != nil {
			return fmt.Errorf("cgroup %s: %w", p, err)
		}
		if filepath.Base(d) == "cpuset" {
			for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
				v, err := os.ReadFile(filepath.Join(d, f))
				if err != nil {
					return err
				}
				if err := os.WriteFile(filepath.Join(p, f), v, 0o644); err != nil {
					return fmt.Errorf("cgroup %s: %w", p, err)
				}
			}
		}
	}
	return nil
}

// cgroupProcs lists every process under root in any hierarchy.
func cgroupProcs(root string) []int {
	var pids []int
	for _, d := range cgroupDirs() {
		_ = filepath.WalkDir(filepath.Join(d, root), func(p string, e os.DirEntry, err error) error {
			if err != nil || e.Name() != "cgroup.procs" {
				return nil
			}
			b, _ := os.ReadFile(p)
			for _, f := range strings.Fields(string(b)) {
				if pid, err := strconv.Atoi(f); err == nil {
					pids = append(pids, pid)
				}
			}
			return nil
		})
	}
	return pids
}

func removeCgroups(root string) {
	for _, d := range cgroupDirs() {
		top := filepath.Join(d, root)
		var dirs []string
		_ = filepath.WalkDir(top, func(p string, e os.DirEntry, err error) error {
			if err == nil && e.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
		for i := len(dirs) - 1; i >= 0; i-- {
			_ = syscall.Rmdir(dirs[i])
		}
	}
}

// mountNSProcs lists the processes in the mount namespace of pid.
func mountNSProcs(pid int) []int {
	want, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/mnt", pid))
	if err != nil {
		return nil
	}
	ents, _ := os.ReadDir("/proc")
	var pids []int
	for _, e := range ents {
		p, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if l, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/mnt", p)); err == nil && l == want {
			pids = append(pids, p)
		}
	}
	return pids
}

// stop kills every process the cluster started (kubelets and containerd
// first, then the pods' processes and shims, found by cgroup and by mount
// namespace), removes the cgroups, the namespaces and the scratch
// directory.
func (c *kcluster) stop() {
	t0 := time.Now()
	byName := map[string]*kproc{}
	for _, p := range c.procs {
		byName[p.name] = p
	}
	term := func(p *kproc) {
		if p == nil || p.exited() {
			return
		}
		_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGTERM)
		select {
		case <-p.done:
		case <-time.After(15 * time.Second):
			_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
			<-p.done
		}
	}
	for _, n := range c.nodes {
		term(byName[n.name+"-kubelet"])
		term(byName[n.name+"-containerd"])
		// Pods' processes (in kubelet's cgroups) and shims (in the node's
		// mount namespace), until none is left.
		for i := 0; i < 50; i++ {
			pids := cgroupProcs(n.cgroup)
			if n.holder != nil && n.holder.Process != nil {
				for _, p := range mountNSProcs(n.holder.Process.Pid) {
					if p != n.holder.Process.Pid {
						pids = append(pids, p)
					}
				}
			}
			if len(pids) == 0 {
				break
			}
			for _, p := range pids {
				_ = syscall.Kill(p, syscall.SIGKILL)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	for i := len(c.procs) - 1; i >= 0; i-- {
		term(c.procs[i])
	}
	for _, p := range c.procs {
		p.log.Close()
	}
	for _, n := range c.nodes {
		removeCgroups(n.cgroup)
		_, _ = run("ip", "netns", "del", n.netns)
	}
	_, _ = run("ip", "netns", "del", c.router)
	if os.Getenv("KVIPAM_K8S_KEEP") == "" {
		_ = os.RemoveAll(c.dir)
	} else {
		logf("kept %s", c.dir)
	}
	logf("cluster stopped in %s", time.Since(t0).Round(time.Millisecond))
}

// --- the API: objects as JSON ---

type objMeta struct {
	Name              string            `json:"name"`
	Namespace         string            `json:"namespace"`
	UID               string            `json:"uid"`
	Annotations       map[string]string `json:"annotations"`
	CreationTimestamp time.Time         `json:"creationTimestamp"`
	DeletionTimestamp *time.Time        `json:"deletionTimestamp"`
}

type condition struct {
	Type               string    `json:"type"`
	Status             string    `json:"status"`
	Reason             string    `json:"reason"`
	Message            string    `json:"message"`
	LastTransitionTime time.Time `json:"lastTransitionTime"`
}

type pod struct {
	Metadata objMeta `json:"metadata"`
	Spec     struct {
		NodeName string `json:"nodeName"`
	} `json:"spec"`
	Status struct {
		Phase        string                `json:"phase"`
		PodIPs       []struct{ IP string } `json:"podIPs"`
		Conditions   []condition           `json:"conditions"`
		InitStatuses []struct {
			Name  string `json:"name"`
			Ready bool   `json:"ready"`
			State struct {
				Terminated *struct {
					ExitCode int    `json:"exitCode"`
					Reason   string `json:"reason"`
				} `json:"terminated"`
			} `json:"state"`
		} `json:"initContainerStatuses"`
		ContainerStatuses []struct {
			Name         string `json:"name"`
			Ready        bool   `json:"ready"`
			RestartCount int    `json:"restartCount"`
		} `json:"containerStatuses"`
	} `json:"status"`
}

func (p pod) ready() bool {
	for _, c := range p.Status.Conditions {
		if c.Type == "Ready" {
			return c.Status == "True"
		}
	}
	return false
}

func (p pod) ips() []string {
	var ips []string
	for _, ip := range p.Status.PodIPs {
		ips = append(ips, ip.IP)
	}
	return ips
}

func (c *kcluster) getPods(args ...string) ([]pod, error) {
	out, err := c.kubectl(append([]string{"get", "pods", "-o", "json"}, args...)...)
	if err != nil {
		return nil, err
	}
	var l struct{ Items []pod }
	if err := json.Unmarshal([]byte(out), &l); err != nil {
		return nil, fmt.Errorf("decode pods: %w", err)
	}
	return l.Items, nil
}

func (c *kcluster) getPod(ns, name string) (pod, error) {
	out, err := c.kubectl("-n", ns, "get", "pod", name, "-o", "json")
	if err != nil {
		return pod{}, err
	}
	var p pod
	if err := json.Unmarshal([]byte(out), &p); err != nil {
		return pod{}, fmt.Errorf("decode pod: %w", err)
	}
	return p, nil
}

// ipRecord is one allocation as kvipamctl ip list -o json prints it.
type ipRecord struct {
	Pool      string `json:"pool"`
	IP        string `json:"ip"`
	Node      string `json:"node"`
	State     string `json:"state"`
	Namespace string `json:"namespace"`
	Pod       string `json:"pod"`
	PodUID    string `json:"podUID"`
	Identity  string `json:"identity"`
}

func (c *kcluster) ipRecords() ([]ipRecord, error) {
	out, err := c.kvipamctl("-o", "json", "ip", "list")
	if err != nil {
		return nil, err
	}
	var recs []ipRecord
	if err := json.Unmarshal([]byte(out), &recs); err != nil {
		return nil, fmt.Errorf("decode kvipamctl ip list: %w: %s", err, tail(out, 500))
	}
	return recs, nil
}

var _ = context.Background
