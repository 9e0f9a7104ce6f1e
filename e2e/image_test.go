package e2e

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	cri "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// TestImageInstall: the image built twice has the same digest; imported
// into a private containerd, its install-cni container, run in a
// host-network pod with the node's CNI directories mounted, installs the
// plugins and the conflist; containerd's CRI then runs a pod with them.
func TestImageInstall(t *testing.T) {
	requireContainerd(t)
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	n := newNode(t, "img")
	n.startAgent(agentOpts{pools: []string{"default=10.16.0.0/16"}})

	// The image carries a conflist for this node's agent.
	const ref = "kvipam.test/kvipam:1"
	conf := filepath.Join(n.dir, "10-kvipam.conflist")
	require.NoError(t, os.WriteFile(conf, []byte(fmt.Sprintf(
		`{"cniVersion":"1.0.0","name":"kvipam","plugins":[{"type":"kvipam","agentSocket":%q,"delQueueDir":%q,"agentTimeout":"10s"}]}`,
		n.socket, n.queue)), 0o644))
	image := func(out string) string {
		cmd := exec.CommandContext(ctx, "go", "run", "github.com/kvipam/kvipam/cmd/kvipam-image", "--out", out, "--ref", ref, "--conflist", conf)
		b, err := cmd.Output()
		require.NoError(t, err, "kvipam-image: %s", b)
		f := strings.Fields(string(b))
		require.Len(t, f, 3, "path ref digest: %s", b)
		return f[2]
	}
	a, b := filepath.Join(n.dir, "a.tar"), filepath.Join(n.dir, "b.tar")
	da, db := image(a), image(b)
	require.Equal(t, da, db, "make image twice: the same digest")
	t.Logf("image %s %s", ref, da)

	hostBin, hostConf := filepath.Join(n.dir, "host-cni-bin"), filepath.Join(n.dir, "host-net.d")
	require.NoError(t, os.MkdirAll(hostBin, 0o755))
	c := startContainerdDirs(t, n, hostBin, hostConf)
	out, err := exec.Command("ctr", "--address", c.socket, "-n", "k8s.io", "images", "import", a).CombinedOutput()
	require.NoError(t, err, "ctr images import: %s", out)

	// The installer: a host-network pod, as the DaemonSet's init container.
	logs := filepath.Join(n.dir, "pod-logs")
	require.NoError(t, os.MkdirAll(logs, 0o755))
	sb := criPod("kvipam-agent-x", "kube-system", podUID("installer"), nil)
	sb.LogDirectory = logs
	sb.Hostname = "" // a host-network pod keeps the host's name, as kubelet sends it
	sb.Linux.SecurityContext = &cri.LinuxSandboxSecurityContext{NamespaceOptions: &cri.NamespaceOption{Network: cri.NamespaceMode_NODE}}
	r, err := c.rt.RunPodSandbox(ctx, &cri.RunPodSandboxRequest{Config: sb})
	require.NoError(t, err)
	cc, err := c.rt.CreateContainer(ctx, &cri.CreateContainerRequest{PodSandboxId: r.PodSandboxId, SandboxConfig: sb, Config: &cri.ContainerConfig{
		Metadata: &cri.ContainerMetadata{Name: "install-cni"},
		Image:    &cri.ImageSpec{Image: ref},
		Command:  []string{"/usr/local/bin/kvipam-agent", "install-cni", "--bin-dir", "/host/opt/cni/bin", "--conf-dir", "/host/etc/cni/net.d"},
		Mounts: []*cri.Mount{
			{ContainerPath: "/host/opt/cni/bin", HostPath: hostBin},
			{ContainerPath: "/host/etc/cni/net.d", HostPath: hostConf},
		},
		LogPath: "install-cni.log",
	}})
	require.NoError(t, err)
	_, err = c.rt.StartContainer(ctx, &cri.StartContainerRequest{ContainerId: cc.ContainerId})
	require.NoError(t, err)
	var st *cri.ContainerStatus
	waitFor(t, 60*time.Second, "the installer to exit", func() bool {
		s, err := c.rt.ContainerStatus(ctx, &cri.ContainerStatusRequest{ContainerId: cc.ContainerId})
		require.NoError(t, err)
		st = s.Status
		return st.State == cri.ContainerState_CONTAINER_EXITED
	})
	log, _ := os.ReadFile(filepath.Join(logs, "install-cni.log"))
	require.Zero(t, st.ExitCode, "install-cni: %s", log)
	for _, f := range []string{"kvipam", "kvipam-ipam", "loopback"} {
		fi, err := os.Stat(filepath.Join(hostBin, f))
		require.NoError(t, err, "%s installed", f)
		require.NotZero(t, fi.Mode()&0o111, "%s executable", f)
	}
	_, err = os.Stat(filepath.Join(hostConf, "10-kvipam.conflist"))
	require.NoError(t, err, "the conflist installed")

	// containerd picks up the conflist and runs a pod with the plugins.
	var ip string
	waitFor(t, 30*time.Second, "a pod networked with the installed plugins", func() bool {
		r, err := c.rt.RunPodSandbox(ctx, &cri.RunPodSandboxRequest{Config: criPod(fmt.Sprintf("app-%d", time.Now().UnixNano()%1e6), "default", podUID("app"), nil)})
		if err != nil {
			return false // the CNI configuration not loaded yet
		}
		s, err := c.rt.PodSandboxStatus(ctx, &cri.PodSandboxStatusRequest{PodSandboxId: r.PodSandboxId})
		require.NoError(t, err)
		ip = s.Status.Network.Ip
		return ip != ""
	})
	require.True(t, strings.HasPrefix(ip, "10.16."), "an address from the agent: %s", ip)
}
