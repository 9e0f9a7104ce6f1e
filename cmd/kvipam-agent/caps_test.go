package main

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

	"github.com/kvipam/kvipam/agent/client"
	"github.com/kvipam/kvipam/internal/testsupport/nstest"
	"github.com/kvipam/kvipam/internal/testsupport/syncbuf"
)

// TestAgentRunsWithManifestCapabilities runs the agent binary as the
// DaemonSet's container runs it: root with only the capabilities the
// manifest adds (bounding, permitted, effective and inheritable sets
// limited to them, as a container runtime does), inside a network
// namespace of its own as in the host's, with the eBPF datapath required.
// It becomes ready on the eBPF datapath (the probe, the maps and links
// pinned in bpffs), and a pod's ADD through the plugin, which the runtime
// runs with full privileges, gets an address with the program attached to
// its host veth; its DEL releases it. With BPF and PERFMON in place of
// SYS_ADMIN the eBPF datapath is refused: the probe cannot create its
// throwaway network namespace. That is why the manifest adds SYS_ADMIN.
func TestAgentRunsWithManifestCapabilities(t *testing.T) {
	nstest.RequireRoot(t)
	for _, tool := range []string{"nsenter", "setpriv"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("no %s", tool)
		}
	}
	ms := loadManifests(t)
	c := ms.daemonSets["kvipam-agent"].Spec.Template.Spec.Containers[0]
	require.NotNil(t, c.SecurityContext)
	require.NotNil(t, c.SecurityContext.Capabilities)
	var caps []string
	for _, c := range c.SecurityContext.Capabilities.Add {
		caps = append(caps, strings.ToLower(string(c)))
	}
	agentBin := buildAgent(t)
	plugin := filepath.Join(filepath.Dir(agentBin), "kvipam")
	if _, err := os.Stat(plugin); err != nil {
		out, err := exec.Command("go", "build", "-o", plugin, "../kvipam").CombinedOutput()
		require.NoError(t, err, string(out))
	}

	// start runs the agent with caps in a new namespace and returns its
	// socket, its namespace, its output and a channel closed when it exits.
	start := func(t *testing.T, caps []string) (string, string, *syncbuf.Buffer, chan struct{}) {
		node := nstest.NewNS(t)
		sockDir, err := os.MkdirTemp("", "kvipam-sock-")
		require.NoError(t, err)
		t.Cleanup(func() { os.RemoveAll(sockDir) })
		pins, err := os.MkdirTemp("/sys/fs/bpf", "kvipam-captest-")
		require.NoError(t, err, "bpffs at /sys/fs/bpf")
		t.Cleanup(func() { os.RemoveAll(pins) })
		socket := filepath.Join(sockDir, "agent.sock")
		set := "-all"
		for _, c := range caps {
			set += ",+" + c
		}
		args := []string{"--net=" + node.Path(), "setpriv", "--bounding-set=" + set, "--inh-caps=" + set, "--",
			agentBin, "--node", "cap-node", "--etcd-embedded", "--state-dir", t.TempDir(), "--socket", socket,
			"--pool", "default=10.94.0.0/24", "--block-size-v4", "28", "--datapath", "bpf", "--bpf-pin-dir", pins,
			"--metrics-addr", "", "--mtu", "1500", "--routing", "none"}
		cmd := exec.Command("nsenter", args...)
		out := &syncbuf.Buffer{}
		cmd.Stdout, cmd.Stderr = out, out
		require.NoError(t, cmd.Start())
		exited := make(chan struct{})
		go func() { _ = cmd.Wait(); close(exited) }()
		t.Cleanup(func() { _ = cmd.Process.Kill(); <-exited })
		return socket, node.Path(), out, exited
	}

	t.Run("manifest", func(t *testing.T) {
		socket, node, out, exited := start(t, caps)
		ctx := context.Background()
		ac := client.New(socket, 5*time.Second)
		require.Eventually(t, func() bool {
			select {
			case <-exited:
				t.Fatalf("the agent with %v exited: %s", caps, out)
			default:
			}
			st, err := ac.Status(ctx)
			return err == nil && st.Ready
		}, 90*time.Second, 50*time.Millisecond, "the agent with %v becomes ready: %s", caps, out)
		st, err := ac.Status(ctx)
		require.NoError(t, err)
		require.Equal(t, "bpf", st.Datapath)

		// The runtime runs the plugin, fully privileged, in the node's
		// namespace: the host veth lands there, and the agent attaches
		// its program to it.
		pod := nstest.NewNS(t)
		conf := fmt.Sprintf(`{"cniVersion":"1.0.0","name":"kvipam","type":"kvipam","agentSocket":%q,"delQueueDir":%q,"agentTimeout":"10s"}`,
			socket, filepath.Join(t.TempDir(), "del-queue"))
		runPlugin := func(command string) (string, error) {
			p := exec.Command("nsenter", "--net="+node, plugin)
			p.Env = append(os.Environ(), "CNI_COMMAND="+command, "CNI_CONTAINERID=cap-pod", "CNI_NETNS="+pod.Path(),
				"CNI_IFNAME=eth0", "CNI_PATH="+filepath.Dir(plugin))
			p.Stdin = strings.NewReader(conf)
			b, err := p.CombinedOutput()
			return string(b), err
		}
		res, err := runPlugin("ADD")
		require.NoError(t, err, "ADD: %s\nagent: %s", res, out)
		require.Contains(t, res, "10.94.0.")
		eps, err := ac.Endpoints(ctx)
		require.NoError(t, err)
		require.Len(t, eps, 1)
		require.Equal(t, "bpf", eps[0].Datapath, "the program is attached to the host veth")
		res, err = runPlugin("DEL")
		require.NoError(t, err, "DEL: %s\nagent: %s", res, out)
	})

	t.Run("BPF and PERFMON instead of SYS_ADMIN", func(t *testing.T) {
		less := []string{"bpf", "perfmon"}
		for _, c := range caps {
			if c != "sys_admin" {
				less = append(less, c)
			}
		}
		_, _, out, exited := start(t, less)
		require.Eventually(t, func() bool {
			select {
			case <-exited:
				return true
			default:
				return false
			}
		}, 2*time.Minute, 50*time.Millisecond, "the agent must refuse the eBPF datapath without SYS_ADMIN: %s", out)
		require.Contains(t, out.String(), "datapath bpf", out.String())
		require.Contains(t, out.String(), "create network namespace: operation not permitted", out.String())
	})
}
