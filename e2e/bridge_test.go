package e2e

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"testing"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/invoke"
	"github.com/containernetworking/cni/pkg/types"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"

	"github.com/kvipam/kvipam/agent/api"
)

const bridgePool = "br=10.2.0.0/16"

// bridgeList is the containernetworking bridge with kvipam-ipam.
func (n *node) bridgeList(name string) *libcni.NetworkConfigList {
	return conflist(n.t, fmt.Sprintf(`{"cniVersion":"1.1.0","name":%q,"plugins":[
		{"type":"bridge","bridge":"kvbr0","capabilities":{"ips":true},
		 "ipam":{"type":"kvipam-ipam","pool":"br","agentSocket":%q,"delQueueDir":%q,"logLevel":"debug","logFile":%q}}]}`,
		name, n.socket, n.queue, n.dir+"/ipam.log"))
}

// TestBridgeWithKvipamIPAM: bridge hands its IPAM to kvipam-ipam. ADD,
// CHECK, DEL and GC through libcni; static IPs through the "ips"
// capability; pods on the bridge reach each other once the node routes
// the pool to the bridge.
func TestBridgeWithKvipamIPAM(t *testing.T) {
	n := newNode(t, "node-b")
	n.startAgent(agentOpts{pools: []string{dualStackPool, bridgePool}})
	prepareBridge(t, n)
	l := n.bridgeList("br")
	a, b, c := newPod(t, "a"), newPod(t, "b"), newPod(t, "c")
	static := netip.MustParseAddr("10.2.7.7")
	c.rt.CapabilityArgs = map[string]any{"ips": []string{static.String() + "/16"}}

	ra := n.mustAdd(l, a)
	n.mustAdd(l, b)
	rc := n.mustAdd(l, c)
	a4, _ := podAddrs(t, ra)
	c4, _ := podAddrs(t, rc)
	require.True(t, netip.MustParsePrefix("10.2.0.0/16").Contains(a4), "from the br pool: %s", a4)
	require.Equal(t, static, c4, "the ips capability")
	require.Len(t, n.ipKeys(a.rt.ContainerID), 1)

	require.NoError(t, n.check(l, a), "bridge CHECK, which calls kvipam-ipam's")
	require.NoError(t, n.statusOf(l), "bridge STATUS forwards to kvipam-ipam")

	require.NoError(t, ping(a.ns, c4))
	require.NoError(t, ping(c.ns, a4))
	require.NoError(t, ping(a.ns, hostAddrV4))

	require.NoError(t, n.del(l, b))
	require.Empty(t, n.ipKeys(b.rt.ContainerID))
	require.NoError(t, n.del(l, b), "a second DEL succeeds")

	// GC through libcni: c is cached but no longer valid, so libcni DELs
	// it (bridge, then kvipam-ipam). bridge (v1.9.1) forwards no GC to
	// its IPAM, so the GC verb itself reaches only top-level plugins.
	valid := &libcni.GCArgs{ValidAttachments: []types.GCAttachment{{ContainerID: a.rt.ContainerID, IfName: "eth0"}}}
	require.NoError(t, n.do(func() error { return n.cni.GCNetworkList(context.Background(), l, valid) }))
	require.Empty(t, n.ipKeys(c.rt.ContainerID), "stale attachment released")
	require.Len(t, n.ipKeys(a.rt.ContainerID), 1, "valid attachment kept")

	// kvipam-ipam's own GC, as a main plugin that forwards GC would call
	// it, releases an allocation no cache knows of.
	_, err := n.client().Allocate(context.Background(), api.AllocateRequest{
		Owner: api.Owner{ContainerID: "leaked", IfName: "eth0", Network: l.Name}, Pool: "br", Permanent: true,
	})
	require.NoError(t, err)
	require.Len(t, n.ipKeys("leaked"), 1)
	gc, err := libcni.InjectConf(l.Plugins[0], map[string]any{"name": l.Name, "cniVersion": l.CNIVersion, "cni.dev/valid-attachments": valid.ValidAttachments})
	require.NoError(t, err)
	require.NoError(t, n.do(func() error {
		return invoke.ExecPluginWithoutResult(context.Background(), n.bin+"/kvipam-ipam", gc.Bytes,
			&invoke.Args{Command: "GC", Path: n.bin}, nil)
	}))
	require.Empty(t, n.ipKeys("leaked"), "released by kvipam-ipam GC")
	require.Len(t, n.ipKeys(a.rt.ContainerID), 1)

	require.NoError(t, n.del(l, a))
	require.Empty(t, n.ipKeys(""))
}

// prepareBridge does what deploy/cni/README.md asks of a node for bridge
// with kvipam-ipam: a bridge with a fixed MAC (else it takes its lowest
// port's, and bridge's CHECK fails when that changes), owning the pods'
// link-local gateway, and a route for the pool to it.
func prepareBridge(t *testing.T, n *node) {
	t.Helper()
	h := nlHandle(t, n.host)
	la := netlink.NewLinkAttrs()
	la.Name = "kvbr0"
	la.HardwareAddr = net.HardwareAddr{0x02, 0x6b, 0x76, 0x00, 0x00, 0x01}
	br := &netlink.Bridge{LinkAttrs: la}
	require.NoError(t, h.LinkAdd(br))
	require.NoError(t, h.LinkSetUp(br))
	require.NoError(t, h.AddrAdd(br, &netlink.Addr{IPNet: ipNet(netip.MustParsePrefix("169.254.1.1/32"))}))
	require.NoError(t, h.RouteAdd(&netlink.Route{LinkIndex: br.Attrs().Index, Dst: ipNet(netip.MustParsePrefix("10.2.0.0/16")), Scope: netlink.SCOPE_LINK}))
}

// TestMacvlanWithKvipamIPAM: macvlan pods on a LAN get addresses from a
// pool carved out of the LAN, with the LAN's prefix and router, as
// deploy/cni/30-macvlan-kvipam-ipam.conflist configures them.
func TestMacvlanWithKvipamIPAM(t *testing.T) {
	n := newNode(t, "node-m")
	n.startAgent(agentOpts{pools: []string{"lan=192.168.50.128/25"}, blockV4: 28})
	// The LAN: the node's uplink0, whose peer is the router's port.
	router := newNS(t)
	h := nlHandle(t, n.host)
	up1, err := h.LinkByName("uplink1")
	require.NoError(t, err)
	require.NoError(t, h.LinkSetNsFd(up1, int(router.Fd())))
	up0, err := h.LinkByName("uplink0")
	require.NoError(t, err)
	require.NoError(t, h.LinkSetUp(up0))
	rh := nlHandle(t, router)
	port, err := rh.LinkByName("uplink1")
	require.NoError(t, err)
	require.NoError(t, rh.AddrAdd(port, &netlink.Addr{IPNet: ipNet(netip.MustParsePrefix("192.168.50.1/24"))}))
	require.NoError(t, rh.LinkSetUp(port))

	l := conflist(t, fmt.Sprintf(`{"cniVersion":"1.1.0","name":"lan","plugins":[{"type":"macvlan","master":"uplink0","mode":"bridge",
		"ipam":{"type":"kvipam-ipam","pool":"lan","agentSocket":%q,"delQueueDir":%q,"prefixLengthV4":24,"gatewayV4":"192.168.50.1"}}]}`,
		n.socket, n.queue))
	a, b := newPod(t, "a"), newPod(t, "b")
	ra, rb := n.mustAdd(l, a), n.mustAdd(l, b)
	require.Equal(t, "192.168.50.1", ra.IPs[0].Gateway.String())
	require.Equal(t, 24, maskLen(ra.IPs[0].Address.Mask))
	b4, _ := podAddrs(t, rb)
	require.NoError(t, ping(a.ns, netip.MustParseAddr("192.168.50.1")), "the LAN's router")
	require.NoError(t, ping(a.ns, b4), "the other pod, on the LAN")
	require.NoError(t, n.check(l, a))
	require.NoError(t, n.del(l, a))
	require.NoError(t, n.del(l, b))
	require.NoError(t, n.del(l, b))
	require.Empty(t, n.ipKeys(""))
}

func maskLen(m net.IPMask) int { ones, _ := m.Size(); return ones }
