package e2e

import (
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"

	"github.com/kvipam/kvipam/e2e/cluster"
)

// TestVXLANIPv6: three nodes on two subnets (no L2 between the racks, no
// route to any pod prefix on the router), one etcd cluster, routing
// vxlan; each node runs a dual-stack pod. Over an IPv4 underlay and then
// an IPv6 one (--vxlan-underlay ipv6), every pod reaches every other
// pod's IPv4 and IPv6 address over the overlay, and the pods' MTU is the
// underlay's less 50 (IPv4) or 70 (IPv6).
func TestVXLANIPv6(t *testing.T) {
	c := cluster.Start(t, cluster.Options{})
	for _, tc := range []struct {
		underlay string
		first    int
		pool     string
		mtu      int
	}{
		{"ipv4", 11, "ul4=10.8.0.0/16,fd00:8::/112", 1450},
		{"ipv6", 21, "ul6=10.7.0.0/16,fd00:7::/112", 1430},
	} {
		t.Run(tc.underlay+"-underlay", func(t *testing.T) {
			r := newRouter(t)
			r.enable6(t)
			type member struct {
				n   *node
				l   *libcni.NetworkConfigList
				p   *pod
				ips [2]netip.Addr
			}
			var ms []*member
			for i, rack := range []string{"A", "A", "B"} {
				name := fmt.Sprintf("x%s%d", tc.underlay[3:], i+1)
				n := newNode(t, name)
				host := tc.first + i
				a4, a6 := r.attach(t, n, rack, host), r.attach6(t, n, rack, host)
				n.startAgent(agentOpts{pools: []string{tc.pool}, etcd: c,
					extra: []string{"--routing", "vxlan", "--vxlan-underlay", tc.underlay, "--node-address", a4.String() + "," + a6.String(), "--mtu", "0"}})
				m := &member{n: n, l: n.kvipamList("kv", "1.0.0", ""), p: newPod(t, name+"-p0")}
				v4, v6 := podAddrs(t, n.mustAdd(m.l, m.p))
				require.True(t, v4.IsValid() && v6.IsValid(), "a dual-stack pod")
				m.ips = [2]netip.Addr{v4, v6}
				require.Equal(t, tc.mtu, linkMTU(t, m.p.ns, "eth0"), "pod MTU: the underlay's less the overlay's overhead")
				ms = append(ms, m)
			}
			for _, m := range ms {
				dev, err := nlHandle(t, m.n.host).LinkByName("kvipam.vxlan")
				require.NoError(t, err)
				vx := dev.(*netlink.Vxlan)
				require.Equal(t, tc.underlay == "ipv6", vx.SrcAddr.To4() == nil, "the VTEP is the node's %s address", tc.underlay)
			}
			for _, from := range ms {
				for _, to := range ms {
					if from == to {
						continue
					}
					for _, ip := range to.ips {
						waitFor(t, 30*time.Second, fmt.Sprintf("%s -> %s (%s) over the overlay", from.n.name, ip, to.n.name), func() bool {
							return ping(from.p.ns, ip) == nil
						})
					}
				}
			}
			for _, m := range ms {
				dev, err := nlHandle(t, m.n.host).LinkByName("kvipam.vxlan")
				require.NoError(t, err)
				require.NotZero(t, dev.Attrs().Statistics.TxPackets, "%s sent pod traffic through the overlay", m.n.name)
				require.NoError(t, m.n.del(m.l, m.p))
			}
		})
	}
}
