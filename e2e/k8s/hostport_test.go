package k8s

import (
	"encoding/json"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestK8sHostPort: a pod with a hostPort, created through the API server
// and run by the real kubelet and containerd with the default conflist
// (kvipam serves portMappings itself, no portmap chained), is reached at
// its node's IPv4 and IPv6 address from a pod on the other node and from
// the node itself; once the pod is deleted the host port is no more.
func TestK8sHostPort(t *testing.T) {
	c := cluster(t)
	c.install(t)
	const ns, hostPort = "k8s-hostport", "18080"
	t.Cleanup(func() { c.deleteNamespace(t, ns) })
	c.ensureNamespace(t, ns)
	spec := podTemplateSpec("n1")
	ctr := spec["containers"].([]any)[0].(map[string]any)
	ctr["command"] = []string{"/kt", "serve", "80"}
	ctr["ports"] = []any{map[string]any{"containerPort": 80, "hostPort": 18080, "protocol": "TCP"}}
	b, err := json.Marshal(map[string]any{
		"apiVersion": "v1", "kind": "Pod",
		"metadata": map[string]any{"name": "web", "namespace": ns, "labels": map[string]string{"kt": "1"}},
		"spec":     spec,
	})
	require.NoError(t, err)
	_, err = c.kubectlIn(string(b), "create", "-f", "-")
	require.NoError(t, err)
	c.waitPodReady(t, ns, "web")
	c.runPod(t, ns, "client", "n2", nil)

	n1 := c.node("n1")
	for _, host := range []string{n1.ip, n1.ip6} {
		dst := net.JoinHostPort(host, hostPort)
		out, err := c.kubectl("-n", ns, "exec", "client", "--", "/kt", "tcp-get", dst)
		require.NoError(t, err, "from a pod on n2 to %s", dst)
		require.True(t, strings.HasPrefix(out, "web "), "from a pod on n2 to %s: answered %q", dst, out)

		var answer string
		require.NoError(t, inNetns("/run/netns/"+n1.netns, func() error {
			c, err := net.DialTimeout("tcp", dst, 10*time.Second)
			if err != nil {
				return err
			}
			defer c.Close()
			_ = c.SetDeadline(time.Now().Add(10 * time.Second))
			b, err := io.ReadAll(c)
			answer = string(b)
			return err
		}), "from node n1 to %s", dst)
		require.True(t, strings.HasPrefix(answer, "web "), "from node n1 to %s: answered %q", dst, answer)
	}

	// kvipam served it: no portmap ran, so the node's nat table has no
	// CNI-HOSTPORT chain (portmap's).
	nat, err := run("nsenter", "--net=/run/netns/"+n1.netns, "--", "iptables-save", "-t", "nat")
	require.NoError(t, err)
	require.NotContains(t, nat, "CNI-HOSTPORT", "the default conflist chains no portmap")

	c.deletePod(t, ns, "web")
	_, err = c.kubectl("-n", ns, "exec", "client", "--", "/kt", "tcp-get", net.JoinHostPort(n1.ip, hostPort))
	require.Error(t, err, "the deleted pod's host port is not served")
}
