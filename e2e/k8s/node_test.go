package k8s

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"time"
)

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

// kubeletSysctls are the six sysctls kubelet sets at start (its
// setupKernelTunables), with the values it writes.
var kubeletSysctls = map[string]string{
	"vm/overcommit_memory": "1", "vm/panic_on_oom": "0", "kernel/panic": "10", "kernel/panic_on_oops": "1",
	"kernel/keys/root_maxkeys": "1000000", "kernel/keys/root_maxbytes": "25000000",
}

// readSysctls reads the host's values of kubeletSysctls.
func readSysctls() map[string]string {
	m := map[string]string{}
	for f := range kubeletSysctls {
		b, _ := os.ReadFile("/proc/sys/" + f)
		m[f] = strings.TrimSpace(string(b))
	}
	return m
}

// sysctls reads the node's scratch copies of kubeletSysctls.
func (n *knode) sysctls() map[string]string {
	m := map[string]string{}
	for f := range kubeletSysctls {
		b, _ := os.ReadFile(filepath.Join(n.dir, "sysctl", strings.ReplaceAll(f, "/", ".")))
		m[f] = strings.TrimSpace(string(b))
	}
	return m
}

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
	n.containerd = ctrd.cmd.Process.Pid // nsenter execs containerd
	if err := waitFor(time.Minute, "containerd's socket", func() error {
		if ctrd.exited() {
			return errors.New("containerd exited: " + c.logTail(n.name+"-containerd"))
		}
		_, err := os.Stat(n.socket)
		return err
	}); err != nil {
		return err
	}
	// Unpacked for the CRI's snapshotter at import, so that the first pod
	// of an image does not pay for it.
	for _, img := range []string{filepath.Join(c.dir, "pause.tar"), filepath.Join(c.dir, "kt.tar"), filepath.Join(c.dir, "bridge.tar"), c.imageTar} {
		if _, err := run("ctr", "--address", n.socket, "-n", "k8s.io", "images", "import", "--snapshotter", "native", "--all-platforms", img); err != nil {
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

// cleanStale removes what an earlier run left when it did not reach its
// stop (a test binary killed by go test's timeout): its processes (pods
// in its cgroups; containerd's shims, which outlive their parent, by its
// scratch directory in their arguments), cgroups, namespaces and scratch
// directory. A run is named by its test binary's process ID in all of
// them, and is stale when that process is gone.
func cleanStale() {
	stale := map[string]bool{}
	gone := func(pid string) bool { _, err := os.Stat("/proc/" + pid); return err != nil }
	nsRE, cgRE := regexp.MustCompile(`^k8s(r|n1|n2|i)-(\d+)$`), regexp.MustCompile(`^kvipam-k8s-(\d+)-n[12]$`)
	ents, _ := os.ReadDir("/run/netns")
	for _, e := range ents {
		if m := nsRE.FindStringSubmatch(e.Name()); m != nil && gone(m[2]) {
			stale[m[2]] = true
		}
	}
	for _, d := range cgroupDirs() {
		ents, _ := os.ReadDir(d)
		for _, e := range ents {
			if m := cgRE.FindStringSubmatch(e.Name()); m != nil && gone(m[1]) {
				stale[m[1]] = true
			}
		}
	}
	for pid := range stale {
		logf("removing what the run of process %s left", pid)
		dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), "kvipam-k8s-"+pid+"-*"))
		cgroups := []string{"/kvipam-k8s-" + pid + "-n1", "/kvipam-k8s-" + pid + "-n2"}
		for i := 0; i < 50; i++ {
			var pids []int
			for _, cg := range cgroups {
				pids = append(pids, cgroupProcs(cg)...)
			}
			for _, d := range dirs {
				pids = append(pids, procsMentioning(d)...)
			}
			if len(pids) == 0 {
				break
			}
			for _, p := range pids {
				_ = syscall.Kill(p, syscall.SIGKILL)
			}
			time.Sleep(100 * time.Millisecond)
		}
		for _, cg := range cgroups {
			removeCgroups(cg)
		}
		for _, ns := range []string{"k8sr-", "k8sn1-", "k8sn2-"} {
			_, _ = run("ip", "netns", "del", ns+pid)
		}
		for _, d := range dirs {
			_ = os.RemoveAll(d)
		}
	}
}

// procsMentioning lists the processes with s in their arguments.
func procsMentioning(s string) []int {
	ents, _ := os.ReadDir("/proc")
	var pids []int
	for _, e := range ents {
		p, err := strconv.Atoi(e.Name())
		if err != nil || p == os.Getpid() {
			continue
		}
		if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", p)); err == nil && strings.Contains(string(b), s) {
			pids = append(pids, p)
		}
	}
	return pids
}
