package k8s

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// --- the networks of the burst, put in place as an operator would ---

// The networks of BenchmarkK8sBurst, in a forward round's order: kvipam
// on its default datapath (bpf) with the conflist it ships for it, hostPort
// served by its datapath and no portmap chained (issue 49); kvipam with
// datapath: routes, portmap chained; bridge+host-local+portmap
// (dual-stack like kvipam's pools); and host-network pods, the floor (no
// network set-up at all).
var burstNetworks = []string{"kvipam", "kvipam-routes", "bridge", "hostnet"}

var networkLabels = map[string]string{
	"kvipam": "kvipam (bpf datapath, no portmap)", "kvipam-routes": "kvipam (routes, portmap)",
	"bridge": "bridge + host-local + portmap", "hostnet": "host network (the floor)",
}

// useNetwork makes net the nodes' network as an operator would: kvipam
// installed (docs/kubernetes.md) with the ConfigMap's datapath, changed
// by editing the ConfigMap and a rollout restart of the DaemonSet;
// bridge by uninstalling kvipam (containerd takes the first conflist)
// and the bridge DaemonSet; host-network pods need no network, only
// Ready nodes (whatever is installed stays).
func (c *kcluster) useNetwork(tb testing.TB, net string) {
	tb.Helper()
	t0 := time.Now()
	switch net {
	case "kvipam":
		c.setDatapath(tb, "auto", "bpf", false)
	case "kvipam-routes":
		c.setDatapath(tb, "routes", "routes", true)
	case "bridge":
		if c.installed {
			c.uninstall(tb)
		}
		c.ensureBridge(tb)
	case "hostnet":
		if !c.installed {
			c.ensureBridge(tb)
		}
	default:
		tb.Fatalf("unknown network %q", net)
	}
	if d := time.Since(t0); d > time.Second {
		logf("network %s in place in %s", net, d.Round(time.Millisecond))
	}
}

// setDatapath installs kvipam with the ConfigMap's datapath dp and its
// conflist with portmap chained or not, or, when installed otherwise,
// edits the ConfigMap, restarts the DaemonSet and waits for its rollout;
// then n1's agent says it is ready on want.
func (c *kcluster) setDatapath(tb testing.TB, dp, want string, portmap bool) {
	tb.Helper()
	cur := c.datapath
	if cur == "" {
		cur = "auto"
	}
	switch {
	case !c.installed:
		c.datapath, c.noPortmap = dp, !portmap
		c.install(tb)
	case cur != dp || c.noPortmap == portmap:
		c.datapath, c.noPortmap = dp, !portmap
		manifest, err := c.agentManifest()
		require.NoError(tb, err)
		_, err = c.kubectl("apply", "-f", manifest)
		require.NoError(tb, err)
		_, err = c.kubectl("-n", "kube-system", "rollout", "restart", "ds/kvipam-agent")
		require.NoError(tb, err)
		c.waitDaemonSet(tb, "kvipam-agent")
		c.waitNodesReady(tb)
	}
	require.NoError(tb, waitFor(2*time.Minute, "n1's agent ready on the "+want+" datapath", func() error {
		pods, err := c.getPods("-n", "kube-system", "-l", "app=kvipam-agent", "--field-selector", "spec.nodeName=n1")
		if err != nil {
			return err
		}
		for _, p := range pods {
			if p.Metadata.DeletionTimestamp != nil || !p.ready() {
				continue
			}
			logs, err := c.kubectl("-n", "kube-system", "logs", p.Metadata.Name, "-c", "agent")
			if err != nil {
				return err
			}
			for _, l := range strings.Split(logs, "\n") {
				if strings.Contains(l, "agent ready") {
					if strings.Contains(l, "datapath="+want) || strings.Contains(l, `"datapath":"`+want+`"`) {
						return nil
					}
					return fmt.Errorf("agent %s: %s", p.Metadata.Name, l)
				}
			}
		}
		return fmt.Errorf("no ready agent on n1 has logged agent ready")
	}))
}

func (c *kcluster) ensureBridge(tb testing.TB) {
	tb.Helper()
	if c.bridgeOn {
		return
	}
	path := filepath.Join(c.dir, "cni-bridge.yaml")
	require.NoError(tb, os.WriteFile(path, []byte(bridgeDaemonSet), 0o644))
	_, err := c.kubectl("apply", "-f", path)
	require.NoError(tb, err)
	c.bridgeOn = true
	c.waitDaemonSet(tb, "cni-bridge")
	c.waitNodesReady(tb)
}
