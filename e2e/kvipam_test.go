package e2e

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"

	"github.com/kvipam/kvipam/cni"
)

const dualStackPool = "default=10.1.0.0/16,fd00:1::/64"

// TestKvipamTwoPods: two pods on a node get dual-stack addresses, reach
// each other and the node, pass CHECK, and DEL removes their interfaces,
// routes, endpoint and etcd records; a second DEL succeeds.
func TestKvipamTwoPods(t *testing.T) {
	n := newNode(t, "node-a")
	n.startAgent(agentOpts{pools: []string{dualStackPool}})
	l := n.kvipamList("pods", "1.1.0", "")
	a, b := newPod(t, "a"), newPod(t, "b")

	ra, rb := n.mustAdd(l, a), n.mustAdd(l, b)
	a4, a6 := podAddrs(t, ra)
	b4, b6 := podAddrs(t, rb)
	require.True(t, a4.IsValid() && a6.IsValid() && b4.IsValid() && b6.IsValid(), "dual stack: %s", prettyJSON(ra))
	require.NotEqual(t, a4, b4)

	for _, c := range []struct {
		from *pod
		to   netip.Addr
	}{{a, b4}, {a, b6}, {b, a4}, {b, a6}, {a, hostAddrV4}, {a, hostAddrV6}, {b, hostAddrV4}} {
		require.NoError(t, ping(c.from.ns, c.to), "ping %s -> %s", c.from.name, c.to)
	}
	require.NoError(t, ping(n.host, a4), "the node reaches the pod")
	require.NoError(t, ping(n.host, b6))

	require.NoError(t, n.check(l, a))
	require.NoError(t, n.check(l, b))

	keys := n.ipKeys(a.rt.ContainerID)
	require.Len(t, keys, 2, "one etcd key per address")
	for _, v := range keys {
		require.Contains(t, v, `"state":"allocated"`)
		require.Contains(t, v, `"namespace":"e2e"`)
		require.Contains(t, v, `"pod":"a"`)
		require.Contains(t, v, `"podUID":"`+podUID("a")+`"`, "the pod's UID from K8S_POD_UID")
	}

	require.NoError(t, n.del(l, a))
	// The routes are gone when DEL answers; the veth (retired, down) is
	// deleted by the agent in the background.
	for _, ip := range []netip.Addr{a4, a6} {
		require.False(t, hostRouteTo(t, n, ip), "host route to %s removed", ip)
	}
	hostIf := cni.HostVethName(a.rt.ContainerID, "eth0")
	waitFor(t, 30*time.Second, "the host veth to be deleted", func() bool {
		_, err := nlHandle(t, n.host).LinkByName(hostIf)
		return err != nil
	})
	_, err := nlHandle(t, a.ns).LinkByName("eth0")
	require.Error(t, err, "pod interface removed")
	require.Empty(t, n.ipKeys(a.rt.ContainerID), "etcd records removed")
	eps, err := n.client().Endpoints(context.Background())
	require.NoError(t, err)
	for _, ep := range eps {
		require.NotEqual(t, a.rt.ContainerID, ep.Owner.ContainerID, "endpoint removed")
	}
	require.NoError(t, n.del(l, a), "a second DEL succeeds")

	require.NoError(t, ping(b.ns, hostAddrV4), "the other pod is untouched")
	require.NoError(t, n.del(l, b))
	require.Empty(t, n.ipKeys(""))
}

// hostRouteTo reports whether the node has a route to exactly ip/32 or
// ip/128.
func hostRouteTo(t *testing.T, n *node, ip netip.Addr) bool {
	t.Helper()
	fam := netlink.FAMILY_V4
	if ip.Is6() {
		fam = netlink.FAMILY_V6
	}
	rs, err := nlHandle(t, n.host).RouteListFiltered(fam, &netlink.Route{Dst: ipNet(netip.PrefixFrom(ip, ip.BitLen()))}, netlink.RT_FILTER_DST)
	require.NoError(t, err)
	return len(rs) > 0
}

// TestKvipamAnswersInTheConflistVersion: a runtime reads the result in the
// version it asked for (containerd 1.6 cannot read 1.1.0).
func TestKvipamAnswersInTheConflistVersion(t *testing.T) {
	n := newNode(t, "node-v")
	n.startAgent(agentOpts{pools: []string{dualStackPool}})
	for i, v := range []string{"0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"} {
		t.Run(v, func(t *testing.T) {
			l := n.kvipamList(fmt.Sprintf("v%d", i), v, "")
			p := newPod(t, fmt.Sprintf("v%d", i))
			var res types.Result
			require.NoError(t, n.do(func() (err error) {
				res, err = n.cni.AddNetworkList(context.Background(), l, p.rt)
				return err
			}))
			require.Equal(t, v, res.Version())
			if v != "0.3.0" && v != "0.3.1" {
				require.NoError(t, n.check(l, p))
			}
			require.NoError(t, ping(p.ns, hostAddrV4))
			require.NoError(t, n.del(l, p))
		})
	}
}

// TestKvipamChained: kvipam first, then tuning, bandwidth and portmap, as
// a Kubernetes conflist has them. A pod reaches another pod through the
// node's host port. With the bpf datapath, the pod whose egress is limited
// is attached with TCX (bandwidth then adds its ingress qdisc beside it),
// the other with a clsact filter.
func TestKvipamChained(t *testing.T) {
	if _, err := exec.LookPath("iptables"); err != nil {
		t.Skip("portmap needs iptables; .ci/run installs it")
	}
	n := newNode(t, "node-c")
	n.startAgent(agentOpts{pools: []string{dualStackPool}})
	l := n.kvipamList("chained", "1.0.0", `,"capabilities":{"bandwidth":true}`,
		`{"type":"tuning","sysctl":{"net.ipv4.conf.eth0.arp_notify":"1"}}`,
		`{"type":"bandwidth","capabilities":{"bandwidth":true}}`,
		`{"type":"portmap","capabilities":{"portMappings":true},"backend":"iptables"}`,
	)
	web, client := newPod(t, "web"), newPod(t, "client")
	web.rt.CapabilityArgs = map[string]any{
		"portMappings": []map[string]any{{"hostPort": 8080, "containerPort": 80, "protocol": "tcp"}},
		"bandwidth":    map[string]any{"ingressRate": 100_000_000, "ingressBurst": 10_000_000, "egressRate": 100_000_000, "egressBurst": 10_000_000},
	}
	rw := n.mustAdd(l, web)
	n.mustAdd(l, client)
	w4, _ := podAddrs(t, rw)
	if datapathFlag() == "bpf" {
		require.Equal(t, "tcx", n.attachedWith(t, web), "egress limited: tcx, beside bandwidth's ingress qdisc")
		require.Equal(t, "tc", n.attachedWith(t, client))
	}

	var v string
	require.NoError(t, web.ns.Do(func(ns.NetNS) error {
		b, err := readFile("/proc/sys/net/ipv4/conf/eth0/arp_notify")
		v = b
		return err
	}))
	require.Equal(t, "1", strings.TrimSpace(v), "tuning ran on kvipam's interface")

	var ln net.Listener
	require.NoError(t, web.ns.Do(func(ns.NetNS) (err error) { ln, err = net.Listen("tcp", w4.String()+":80"); return err }))
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			_, _ = c.Write([]byte("hello from web"))
			_ = c.Close()
		}
	}()
	require.NoError(t, client.ns.Do(func(ns.NetNS) error {
		c, err := net.Dial("tcp", hostAddrV4.String()+":8080")
		if err != nil {
			return err
		}
		defer c.Close()
		buf := make([]byte, 64)
		nr, err := c.Read(buf)
		if err == nil && string(buf[:nr]) != "hello from web" {
			err = errors.New("wrong answer " + string(buf[:nr]))
		}
		return err
	}), "client -> node:8080 -> web:80 through portmap")

	require.NoError(t, n.check(l, web))
	require.NoError(t, n.del(l, web))
	require.NoError(t, n.del(l, client))
	require.NoError(t, n.del(l, web), "a second DEL of the chain succeeds")
	require.Empty(t, n.ipKeys(""))
}

// TestKvipamGC: libcni's GCNetworkList DELs cached attachments that are
// not valid, and kvipam's GC releases allocations the cache does not know
// (an ADD whose cache entry was lost) and removes their veths.
func TestKvipamGC(t *testing.T) {
	n := newNode(t, "node-g")
	n.startAgent(agentOpts{pools: []string{dualStackPool}})
	l := n.kvipamList("gc", "1.1.0", "")
	keep, stale, lost := newPod(t, "keep"), newPod(t, "stale"), newPod(t, "lost")
	n.mustAdd(l, keep)
	n.mustAdd(l, stale)
	// An ADD through another cache: this node's libcni does not know it.
	other := libcni.NewCNIConfigWithCacheDir([]string{n.bin}, t.TempDir(), nil)
	require.NoError(t, n.do(func() error { _, err := other.AddNetworkList(context.Background(), l, lost.rt); return err }))

	valid := &libcni.GCArgs{ValidAttachments: []types.GCAttachment{{ContainerID: keep.rt.ContainerID, IfName: "eth0"}}}
	require.NoError(t, n.do(func() error { return n.cni.GCNetworkList(context.Background(), l, valid) }))

	require.Len(t, n.ipKeys(keep.rt.ContainerID), 2)
	require.Empty(t, n.ipKeys(stale.rt.ContainerID), "DELed from the cache")
	require.Empty(t, n.ipKeys(lost.rt.ContainerID), "released by kvipam's GC")
	_, err := nlHandle(t, n.host).LinkByName(cni.HostVethName(lost.rt.ContainerID, "eth0"))
	require.Error(t, err, "GC removed the lost pod's veth")
	require.NoError(t, ping(keep.ns, hostAddrV4))
	require.NoError(t, n.check(l, keep))
}

// TestKvipamAddAgainAfterDel: an ADD right after a DEL, in the same netns,
// of the same attachment (as cnitool or a runtime retrying a sandbox does)
// or of another container, works whether or not the agent has deleted the retired
// veth yet, and the pod is reachable each time.
func TestKvipamAddAgainAfterDel(t *testing.T) {
	n := newNode(t, "node-again")
	n.startAgent(agentOpts{pools: []string{dualStackPool}})
	l := n.kvipamList("pods", "1.1.0", "")
	a := newPod(t, "a")
	id := a.rt.ContainerID
	for i := range 6 {
		// Every other round another container in the same netns (as a
		// runtime reusing a sandbox's netns does).
		a.rt.ContainerID = fmt.Sprintf("%s-%d", id, i%2)
		r := n.mustAdd(l, a)
		a4, _ := podAddrs(t, r)
		require.NoError(t, ping(n.host, a4), "round %d: the node reaches the pod", i)
		require.NoError(t, n.del(l, a), "round %d", i)
	}
}
