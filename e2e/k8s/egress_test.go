package k8s

import (
	"bytes"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The "internet" of TestK8sPodReachesOutside: a scratch namespace joined
// to the router's by a veth of its own, with addresses outside every pool
// and outside the cluster's network; the router forwards between it and
// the nodes, and routes no pool.
const (
	inetRouterV4, inetV4 = "203.0.113.1", "203.0.113.2"
	inetRouterV6, inetV6 = "2001:db8:cafe::1", "2001:db8:cafe::2"
)

// TestK8sPodReachesOutside: a pod of the default pool (host-gw, which
// sets no masquerade: on) sends to an address outside every pool, IPv4
// and IPv6, and that address sees the pod's node's address as the
// source; a ping from the pod is answered, though the router has no
// route back to the pod's address.
func TestK8sPodReachesOutside(t *testing.T) {
	c := cluster(t)
	c.install(t)
	inet := c.internet(t)
	const ns = "k8s-egress"
	t.Cleanup(func() { c.deleteNamespace(t, ns) })
	p := c.runPod(t, ns, "out", "n1", nil)
	v4, v6 := requireIPsIn(t, p, "default")
	n1 := c.nodes[0]
	for _, f := range []struct {
		pod, dst, node string
	}{{v4.String(), inetV4, n1.ip}, {v6.String(), inetV6, n1.ip6}} {
		_, err := run("ip", "-n", c.router, "route", "get", f.pod)
		require.Error(t, err, "the router has no route back to the pod's %s: only a translated source can be answered", f.pod)
		c.pingEventually(t, ns, "out", f.dst)

		listen := exec.Command("ip", "netns", "exec", inet, filepath.Join(c.bin, "kt"), "udp-source", f.dst)
		var out, errs bytes.Buffer
		listen.Stdout, listen.Stderr = &out, &errs
		require.NoError(t, listen.Start())
		done := make(chan error, 1)
		go func() { done <- listen.Wait() }()
		time.Sleep(200 * time.Millisecond) // the listener binds; the sender repeats anyway
		_, err = c.kubectl("-n", ns, "exec", "out", "--", "/kt", "udp-send", f.dst)
		require.NoError(t, err)
		select {
		case err := <-done:
			require.NoError(t, err, errs.String())
		case <-time.After(time.Minute):
			_ = listen.Process.Kill()
			t.Fatalf("no datagram reached %s", f.dst)
		}
		require.Equal(t, f.node, strings.TrimSpace(out.String()), "%s sees node n1's address, not the pod's %s", f.dst, f.pod)
	}
}

// internet makes the scratch "internet" namespace and joins it to the
// router's, with forwarding on in the router's; all of it is undone when
// the test ends. It returns the namespace's name.
func (c *kcluster) internet(tb testing.TB) string {
	tb.Helper()
	name := "k8si-" + c.suffix
	_, err := run("ip", "netns", "add", name)
	require.NoError(tb, err)
	tb.Cleanup(func() { _, _ = run("ip", "netns", "del", name) }) // the veth pair goes with it
	sysctl := func(ns, key, val string) (string, error) {
		return run("ip", "netns", "exec", ns, "sh", "-c", "cat /proc/sys/"+key+"; echo "+val+" > /proc/sys/"+key)
	}
	for _, key := range []string{"net/ipv4/ip_forward", "net/ipv6/conf/all/forwarding"} {
		old, err := sysctl(c.router, key, "1")
		require.NoError(tb, err)
		tb.Cleanup(func() { _, _ = sysctl(c.router, key, strings.TrimSpace(old)) })
	}
	for _, a := range [][]string{
		{"-n", c.router, "link", "add", "vinet", "type", "veth", "peer", "name", "eth0", "netns", name},
		{"-n", c.router, "addr", "add", inetRouterV4 + "/24", "dev", "vinet"},
		{"-n", c.router, "addr", "add", inetRouterV6 + "/64", "dev", "vinet", "nodad"},
		{"-n", c.router, "link", "set", "vinet", "up"},
		{"-n", name, "link", "set", "lo", "up"},
		{"-n", name, "addr", "add", inetV4 + "/24", "dev", "eth0"},
		{"-n", name, "addr", "add", inetV6 + "/64", "dev", "eth0", "nodad"},
		{"-n", name, "link", "set", "eth0", "up"},
		{"-n", name, "route", "add", "default", "via", inetRouterV4},
		{"-n", name, "-6", "route", "add", "default", "via", inetRouterV6},
	} {
		_, err := run("ip", a...)
		require.NoError(tb, err)
	}
	return name
}
