package e2e

import (
	"fmt"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/kvipam/kvipam/e2e/cluster"
)

// TestClusterThreeNodesVXLAN: three node namespaces on two subnets
// (10.254.1.0/24: nodes 1 and 2; 10.254.2.0/24: node 3) joined by a
// router namespace, so host-gw cannot reach across; 3 etcd member
// processes; one agent process per node with --routing vxlan; two pods
// per node. Every pod pings every other pod. A fourth node joining
// subnet B gets routes to every block and is reached by every pod.
func TestClusterThreeNodesVXLAN(t *testing.T) {
	c := cluster.Start(t, cluster.Options{})
	r := newRouter(t)
	type member struct {
		n    *node
		l    *libcni.NetworkConfigList
		pods []*pod
		ips  []netip.Addr
	}
	join := func(name, subnet string, host int, pods int) *member {
		n := newNode(t, name)
		addr := r.attach(t, n, subnet, host)
		// --mtu 0: detect, so the pods get the underlay's MTU less the
		// overlay's 50 bytes.
		n.startAgent(agentOpts{pools: []string{"default=10.8.0.0/16"}, etcd: c,
			extra: []string{"--routing", "vxlan", "--node-address", addr.String(), "--mtu", "0"}})
		m := &member{n: n, l: n.kvipamList("kv", "1.0.0", "")}
		for i := range pods {
			p := newPod(t, fmt.Sprintf("%s-p%d", name, i))
			v4, _ := podAddrs(t, n.mustAdd(m.l, p))
			m.pods, m.ips = append(m.pods, p), append(m.ips, v4)
			require.Equal(t, 1450, linkMTU(t, p.ns, "eth0"), "pod MTU: 1500 less the VXLAN overhead")
		}
		return m
	}
	members := []*member{join("vx1", "A", 11, 2), join("vx2", "A", 12, 2), join("vx3", "B", 13, 2)}
	// Node 3 is not on node 1's segment: the kernel refuses a host-gw
	// route to it, so only the overlay can carry their pods' traffic.
	h1 := nlHandle(t, members[0].n.host)
	require.Error(t, h1.RouteAdd(&netlink.Route{Dst: ipNet(netip.MustParsePrefix("10.1.250.0/26")), Gw: netip.MustParseAddr("10.254.2.13").AsSlice()}),
		"no host-gw route from subnet A to subnet B")
	pingAll := func(ms []*member) {
		t.Helper()
		for _, from := range ms {
			for _, p := range from.pods {
				for _, to := range ms {
					for _, ip := range to.ips {
						require.NoError(t, ping(p.ns, ip), "%s -> %s on %s", p.name, ip, to.n.name)
					}
				}
			}
		}
	}
	waitRoutes := func(ms []*member) time.Duration {
		t.Helper()
		began := time.Now()
		for _, m := range ms {
			h := nlHandle(t, m.n.host)
			for _, other := range ms {
				if other == m {
					continue
				}
				block := other.n.poolStatus("default", "ipv4").Blocks[0]
				waitFor(t, 15*time.Second, m.n.name+" to route "+other.n.name+"'s block over vxlan", func() bool {
					return routeOnVXLAN(h, block)
				})
			}
		}
		return time.Since(began)
	}
	waitRoutes(members)
	pingAll(members)
	dev, err := h1.LinkByName("kvipam.vxlan")
	require.NoError(t, err)
	require.NotZero(t, dev.Attrs().Statistics.TxPackets, "pod traffic left node 1 through the overlay")

	// An agent restart adopts the device and every entry: netlink reports
	// no change in node 1's namespace, and the device is the same one.
	w := watchNetlink(t, members[0].n.host)
	synced := strings.Count(readLog(t, members[0].n), "peer routes in sync")
	from := time.Now()
	members[0].n.restartAgent()
	waitFor(t, 10*time.Second, "node 1's restarted agent to sync its routes", func() bool {
		return strings.Count(readLog(t, members[0].n), "peer routes in sync") > synced
	})
	pingAll(members)
	require.Empty(t, w.between(from, time.Now()), "the restarted agent changed nothing in the kernel")
	again, err := h1.LinkByName("kvipam.vxlan")
	require.NoError(t, err)
	require.Equal(t, dev.Attrs().Index, again.Attrs().Index, "the same device")

	fourth := join("vx4", "B", 14, 1)
	members = append(members, fourth)
	took := waitRoutes(members)
	t.Logf("a fourth node joined: every node routes every block over vxlan %s after its pod's ADD", took.Round(time.Millisecond))
	pingAll(members)

	// The fourth node is taken out of service: its pods go, its agent
	// stops and an operator frees its blocks (kvipamctl node remove). The
	// others drop its routes, neighbour and FDB entries.
	blocks := fourth.n.poolStatus("default", "ipv4").Blocks
	for _, p := range fourth.pods {
		require.NoError(t, fourth.n.del(fourth.l, p))
	}
	fourth.n.stopAgent()
	out, err := fourth.n.clusterCtl(c)("node", "remove", fourth.n.name, "--confirm-gone", fourth.n.name, "--last-seen", "0s", "--force")
	require.NoError(t, err, "kvipamctl node remove: %s", out)
	removed := time.Now()
	vtep4 := netip.MustParseAddr("10.254.2.14")
	for _, m := range members[:3] {
		h := nlHandle(t, m.n.host)
		waitFor(t, 15*time.Second, m.n.name+" to forget the fourth node", func() bool {
			for _, b := range blocks {
				if routeOnVXLAN(h, b) {
					return false
				}
			}
			return !overlayEntry(h, netlink.FAMILY_V4, vtep4) && !overlayEntry(h, unix.AF_BRIDGE, vtep4)
		})
	}
	t.Logf("fourth node removed: its routes, neighbour and FDB entries gone from every node %s after node remove returned", time.Since(removed).Round(time.Millisecond))
	pingAll(members[:3])

	for _, m := range members[:3] {
		for _, p := range m.pods {
			require.NoError(t, m.n.del(m.l, p))
		}
	}
}

// overlayEntry reports whether the vxlan device has a permanent
// neighbour (FAMILY_V4) or FDB (AF_BRIDGE) entry for vtep.
func overlayEntry(h *netlink.Handle, family int, vtep netip.Addr) bool {
	l, err := h.LinkByName("kvipam.vxlan")
	if err != nil {
		return false
	}
	ns, err := h.NeighList(l.Attrs().Index, family)
	if err != nil {
		return false
	}
	for _, n := range ns {
		if a, ok := netip.AddrFromSlice(n.IP); ok && a.Unmap() == vtep && n.State&netlink.NUD_PERMANENT != 0 {
			return true
		}
	}
	return false
}

// router is a namespace that routes between two subnets, each a bridge:
// A is 10.254.1.0/24 and B 10.254.2.0/24, the router .1 on both.
type router struct {
	ns ns.NetNS
	h  *netlink.Handle
}

func newRouter(t testing.TB) *router {
	t.Helper()
	r := &router{ns: newNS(t)}
	r.h = nlHandle(t, r.ns)
	for _, s := range []string{"A", "B"} {
		br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "br" + s}}
		require.NoError(t, r.h.LinkAdd(br))
		ad, err := netlink.ParseAddr(fmt.Sprintf("%s.1/24", subnetPrefix(s)))
		require.NoError(t, err)
		require.NoError(t, r.h.AddrAdd(br, ad))
		require.NoError(t, r.h.LinkSetUp(br))
	}
	require.NoError(t, r.ns.Do(func(ns.NetNS) error {
		return os.WriteFile("/proc/sys/net/ipv4/ip_forward", []byte("1"), 0o644)
	}))
	return r
}

func subnetPrefix(s string) string {
	if s == "A" {
		return "10.254.1"
	}
	return "10.254.2"
}

// attach gives node n a link ul0 on subnet s with address .host and a
// default route via the router; it returns the address.
func (r *router) attach(t testing.TB, n *node, s string, host int) netip.Addr {
	t.Helper()
	peer := "p-" + n.name
	require.NoError(t, r.h.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: peer}, PeerName: "ul0", PeerNamespace: netlink.NsFd(int(n.host.Fd()))}))
	pl, err := r.h.LinkByName(peer)
	require.NoError(t, err)
	br, err := r.h.LinkByName("br" + s)
	require.NoError(t, err)
	require.NoError(t, r.h.LinkSetMaster(pl, br))
	require.NoError(t, r.h.LinkSetUp(pl))
	h := nlHandle(t, n.host)
	ul, err := h.LinkByName("ul0")
	require.NoError(t, err)
	addr := netip.MustParseAddr(fmt.Sprintf("%s.%d", subnetPrefix(s), host))
	ad, err := netlink.ParseAddr(addr.String() + "/24")
	require.NoError(t, err)
	require.NoError(t, h.AddrAdd(ul, ad))
	require.NoError(t, h.LinkSetUp(ul))
	gw := netip.MustParseAddr(subnetPrefix(s) + ".1")
	require.NoError(t, h.RouteAdd(&netlink.Route{Gw: gw.AsSlice(), LinkIndex: ul.Attrs().Index}))
	return addr
}

// routeOnVXLAN reports whether block is routed onto the kvipam.vxlan device.
func routeOnVXLAN(h *netlink.Handle, block netip.Prefix) bool {
	l, err := h.LinkByName("kvipam.vxlan")
	if err != nil {
		return false
	}
	routes, err := h.RouteListFiltered(netlink.FAMILY_V4, &netlink.Route{LinkIndex: l.Attrs().Index}, netlink.RT_FILTER_OIF)
	if err != nil {
		return false
	}
	for _, r := range routes {
		if r.Dst != nil && r.Dst.String() == block.String() {
			return true
		}
	}
	return false
}

func linkMTU(t *testing.T, n ns.NetNS, name string) int {
	t.Helper()
	l, err := nlHandle(t, n).LinkByName(name)
	require.NoError(t, err)
	return l.Attrs().MTU
}
