package agent

import (
	"context"
	"net"
	"net/netip"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/google/nftables"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/internal/testsupport/nstest"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
	"github.com/kvipam/kvipam/routing"
)

// The egress tests run real agents, each managing a scratch "node"
// namespace (Config.NetNS), with pods in namespaces of their own joined
// to their node by a veth, and a scratch "internet" namespace joined to
// one node by another veth, holding addresses outside every pool and no
// route to any pool. Nothing touches the test host's namespace: every
// packet stays in namespaces the test made, which go when it ends, also
// when it fails (nstest).

// The node's and the internet's addresses on the link between them.
var (
	nodeWANv4, inetWANv4 = netip.MustParsePrefix("198.51.100.1/24"), netip.MustParsePrefix("198.51.100.2/24")
	nodeWANv6, inetWANv6 = netip.MustParsePrefix("2001:db8:ff::1/64"), netip.MustParsePrefix("2001:db8:ff::2/64")
)

// TestEgressMasqueradeIPv4: a pod of a pool that sets no masquerade, on
// a host-gw node, sends to an address outside every pool, and the
// internet sees the node's address; the pool turned off, it sees the
// pod's; back to the default, the node's again. On both datapaths: the
// eBPF one leaves forwarding to the kernel, where netfilter translates.
func TestEgressMasqueradeIPv4(t *testing.T) {
	for _, dp := range []string{DatapathRoutes, DatapathBPF} {
		t.Run(dp, func(t *testing.T) { testEgressMasquerade(t, allocator.IPv4, dp) })
	}
}

// TestEgressMasqueradeIPv6 is TestEgressMasqueradeIPv4 for IPv6.
func TestEgressMasqueradeIPv6(t *testing.T) {
	for _, dp := range []string{DatapathRoutes, DatapathBPF} {
		t.Run(dp, func(t *testing.T) { testEgressMasquerade(t, allocator.IPv6, dp) })
	}
}

func testEgressMasquerade(t *testing.T, f allocator.Family, datapath string) {
	nstest.RequireRoot(t)
	node, inet := nstest.NewNS(t), nstest.NewNS(t)
	enableForwarding(t, node)
	wan(t, node, inet)
	e := etcdtest.Start(t)
	cfg := testConfig(t, e)
	cfg.NetNS, cfg.Routing, cfg.NodeAddresses = node.Path(), RoutingHostGW, []string{nodeWANv4.Addr().String()}
	if datapath == DatapathBPF {
		cfg.Datapath, cfg.BPFPinDir = DatapathBPF, bpfPinDir(t)
	}
	ta := startAgent(t, cfg, Options{})
	waitEgressTable(t, node, true)

	pod := nstest.NewNS(t)
	v4, v6 := podAttach(t, ta, node, pod, 1, "kvpod1")
	eps, err := ta.c.Endpoints(context.Background())
	require.NoError(t, err)
	require.Equal(t, datapath, eps[0].Datapath, "the endpoint is the datapath's")
	src, dst, nodeAddr := v4, inetWANv4.Addr(), nodeWANv4.Addr()
	if f == allocator.IPv6 {
		src, dst, nodeAddr = v6, inetWANv6.Addr(), nodeWANv6.Addr()
	}
	require.Equal(t, nodeAddr.String(), sourceSeen(t, pod, inet, dst), "the internet sees the node's address, not the pod's %s", src)

	st := etcdstore.New(etcdtest.Client(t, e), etcdstore.Options{})
	setMasquerade(t, st, "off")
	waitEgressTable(t, node, false)
	require.Equal(t, src.String(), sourceSeen(t, pod, inet, dst), "a pool turned off keeps pod addresses (no rules left)")
	setMasquerade(t, st, "default")
	waitEgressTable(t, node, true)
	require.Equal(t, nodeAddr.String(), sourceSeen(t, pod, inet, dst), "back to the routing mode's default")
}

// TestEgressKeepsPodToPod: two host-gw nodes, each with a pod of a
// masquerading pool: a packet from one pod to the other crosses the
// underlay with the sending pod's address, IPv4 and IPv6.
func TestEgressKeepsPodToPod(t *testing.T) {
	nsA, nsB, hA, hB := twoNodes(t)
	for _, n := range []struct {
		ns   ns.NetNS
		h    *netlink.Handle
		addr string
	}{{nsA, hA, "fd00:254::1/64"}, {nsB, hB, "fd00:254::2/64"}} {
		enableForwarding(t, n.ns)
		l, err := n.h.LinkByName("ul0")
		require.NoError(t, err)
		require.NoError(t, n.h.AddrAdd(l, &netlink.Addr{IPNet: ipNetOf(netip.MustParsePrefix(n.addr)), Flags: unix.IFA_F_NODAD}))
	}
	e := etcdtest.Start(t)
	start := func(name string, n ns.NetNS, addrs ...string) *testAgent {
		cfg := testConfig(t, e)
		cfg.Node, cfg.NetNS, cfg.NodeAddresses, cfg.Routing = name, n.Path(), addrs, RoutingHostGW
		return startAgent(t, cfg, Options{})
	}
	a := start("node-a", nsA, "10.254.0.1", "fd00:254::1")
	b := start("node-b", nsB, "10.254.0.2", "fd00:254::2")
	waitEgressTable(t, nsA, true)
	waitEgressTable(t, nsB, true)
	podA, podB := nstest.NewNS(t), nstest.NewNS(t)
	a4, a6 := podAttach(t, a, nsA, podA, 1, "kvpoda")
	b4, b6 := podAttach(t, b, nsB, podB, 2, "kvpodb")
	for _, h := range []*netlink.Handle{hA, hB} {
		require.Eventually(t, func() bool {
			routes, err := h.RouteListFiltered(netlink.FAMILY_ALL, &netlink.Route{Protocol: routing.Protocol}, netlink.RT_FILTER_PROTOCOL)
			return err == nil && len(routes) >= 2
		}, 10*time.Second, 20*time.Millisecond, "each node routes the other's blocks")
	}
	require.Equal(t, a4.String(), sourceSeen(t, podA, podB, b4), "pod to pod across nodes keeps the pod's IPv4 address")
	require.Equal(t, a6.String(), sourceSeen(t, podA, podB, b6), "and its IPv6 address")
	require.Equal(t, b4.String(), sourceSeen(t, podB, podA, a4), "both ways")
}

// enableForwarding turns forwarding on in n, as a node running pods has.
func enableForwarding(t *testing.T, n ns.NetNS) {
	t.Helper()
	require.NoError(t, n.Do(func(ns.NetNS) error {
		for _, k := range []string{"ipv4/ip_forward", "ipv6/conf/all/forwarding"} {
			if err := os.WriteFile("/proc/sys/net/"+k, []byte("1"), 0o644); err != nil {
				return err
			}
		}
		return nil
	}))
}

// wan joins node and inet with a veth named wan0 at both ends, with
// nodeWAN* and inetWAN*; inet has no other route.
func wan(t *testing.T, node, inet ns.NetNS) {
	t.Helper()
	hn, hi := nstest.Handle(t, node), nstest.Handle(t, inet)
	require.NoError(t, hn.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "wan0"}, PeerName: "wan0", PeerNamespace: netlink.NsFd(int(inet.Fd()))}))
	for _, side := range []struct {
		h     *netlink.Handle
		addrs []netip.Prefix
	}{{hn, []netip.Prefix{nodeWANv4, nodeWANv6}}, {hi, []netip.Prefix{inetWANv4, inetWANv6}}} {
		l, err := side.h.LinkByName("wan0")
		require.NoError(t, err)
		for _, a := range side.addrs {
			require.NoError(t, side.h.AddrAdd(l, &netlink.Addr{IPNet: ipNetOf(a), Flags: unix.IFA_F_NODAD}))
		}
		require.NoError(t, side.h.LinkSetUp(l))
	}
}

// podAttach gives the pod in pod the agent's addresses for owner i, as
// the kvipam plugin does: a veth (hostIf in node, eth0 in pod), the
// addresses on eth0, default routes through link-local gateways on the
// host end, a host route per address in node, and the agent's endpoint.
func podAttach(t *testing.T, ta *testAgent, node, pod ns.NetNS, i int, hostIf string) (v4, v6 netip.Addr) {
	t.Helper()
	ctx := context.Background()
	res, err := ta.c.Allocate(ctx, api.AllocateRequest{Owner: owner(i)})
	require.NoError(t, err)
	hn, hp := nstest.Handle(t, node), nstest.Handle(t, pod)
	require.NoError(t, hn.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: hostIf}, PeerName: "eth0", PeerNamespace: netlink.NsFd(int(pod.Fd()))}))
	host, err := hn.LinkByName(hostIf)
	require.NoError(t, err)
	eth0, err := hp.LinkByName("eth0")
	require.NoError(t, err)
	gw4, gw6 := netip.MustParsePrefix("169.254.1.1/32"), netip.MustParsePrefix("fe80::1/64")
	for _, a := range []netip.Prefix{gw4, gw6} {
		require.NoError(t, hn.AddrAdd(host, &netlink.Addr{IPNet: ipNetOf(a), Flags: unix.IFA_F_NODAD}))
	}
	require.NoError(t, hn.LinkSetUp(host))
	require.NoError(t, hp.LinkSetUp(eth0))
	for _, ip := range res.IPs {
		a := ip.Address.Addr()
		require.NoError(t, hp.AddrAdd(eth0, &netlink.Addr{IPNet: ipNetOf(netip.PrefixFrom(a, a.BitLen())), Flags: unix.IFA_F_NODAD}))
		require.NoError(t, hn.RouteReplace(&netlink.Route{LinkIndex: host.Attrs().Index, Dst: ipNetOf(netip.PrefixFrom(a, a.BitLen())), Scope: netlink.SCOPE_LINK}))
		gw := gw6.Addr()
		if a.Is4() {
			v4, gw = a, gw4.Addr()
		} else {
			v6 = a
		}
		require.NoError(t, hp.RouteAdd(&netlink.Route{LinkIndex: eth0.Attrs().Index, Gw: net.IP(gw.AsSlice()), Flags: int(netlink.FLAG_ONLINK)}))
	}
	require.True(t, v4.IsValid() && v6.IsValid(), "the pool gave an address of each family: %v", res.IPs)
	var ips api.Prefixes
	for _, ip := range res.IPs {
		ips = append(ips, ip.Address)
	}
	// The agent's datapath takes the endpoint (the bpf datapath attaches
	// its filter to the host end) and the reservation becomes permanent.
	_, err = ta.c.CreateEndpoint(ctx, api.EndpointRequest{Owner: owner(i), HostIfName: hostIf, IPs: ips})
	require.NoError(t, err)
	nstest.Settle(t, hn)
	nstest.Settle(t, hp)
	return v4, v6
}

// sourceSeen sends a UDP datagram from the from namespace to dst, where
// a socket in the to namespace listens, and returns the source address
// that socket reads (a string: a test's failure then reads as one).
func sourceSeen(t *testing.T, from, to ns.NetNS, dst netip.Addr) string {
	t.Helper()
	var ln *net.UDPConn
	require.NoError(t, to.Do(func(ns.NetNS) (err error) {
		ln, err = net.ListenUDP("udp", &net.UDPAddr{IP: net.IP(dst.AsSlice())})
		return err
	}))
	defer ln.Close()
	var out *net.UDPConn
	require.NoError(t, from.Do(func(ns.NetNS) (err error) {
		out, err = net.DialUDP("udp", nil, ln.LocalAddr().(*net.UDPAddr))
		return err
	}))
	defer out.Close()
	buf := make([]byte, 64)
	// The first datagram may wait for neighbour discovery: send until
	// one comes.
	for try := 0; try < 50; try++ {
		_, err := out.Write([]byte("egress"))
		require.NoError(t, err)
		require.NoError(t, ln.SetReadDeadline(time.Now().Add(100*time.Millisecond)))
		if _, from, err := ln.ReadFromUDPAddrPort(buf); err == nil {
			return from.Addr().Unmap().String()
		}
	}
	t.Fatalf("no datagram reached %s", dst)
	return ""
}

// waitEgressTable waits until kvipam's masquerade table is in n, or is
// not when present is false.
func waitEgressTable(t *testing.T, n ns.NetNS, present bool) {
	t.Helper()
	c, err := nftables.New(nftables.WithNetNSFd(int(n.Fd())))
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		tb, err := findEgressTable(c)
		return err == nil && (tb != nil) == present
	}, 10*time.Second, 20*time.Millisecond, "masquerade table present: %v", present)
}

// setMasquerade sets the default pool's masquerade as kvipamctl pool
// set-masquerade does.
func setMasquerade(t *testing.T, st *etcdstore.Store, s string) {
	t.Helper()
	m, err := allocator.ParseMasquerade(s)
	require.NoError(t, err)
	_, err = st.UpdatePool(context.Background(), testPool.Name, func(p *allocator.Pool) error { p.Masquerade = m; return nil })
	require.NoError(t, err)
}

func ipNetOf(p netip.Prefix) *net.IPNet {
	return &net.IPNet{IP: net.IP(p.Addr().AsSlice()), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
}

// TestEgressSetsUpdatedInPlace programs the nftables rules in a scratch
// namespace: made once; the same plan again changes nothing (an agent
// restart); a pool's new CIDR changes the sets' elements and leaves the
// rules as they were; a table another made is left alone; no
// masquerading pool removes kvipam's table.
func TestEgressSetsUpdatedInPlace(t *testing.T) {
	n := nstest.NewNS(t)
	c, err := nftables.New(nftables.WithNetNSFd(int(n.Fd())))
	require.NoError(t, err)
	other := c.AddTable(&nftables.Table{Family: nftables.TableFamilyINet, Name: "someone-else"})
	require.NoError(t, c.Flush())
	m := nftMasquerader{netns: n.Path()}
	pool := allocator.Pool{Name: "p", CIDRs: prefixes("10.42.0.0/16", "fd00:42::/64")}
	changed, err := m.program(planEgress([]allocator.Pool{pool}, true, nil))
	require.NoError(t, err)
	require.True(t, changed)
	handles := func() []uint64 {
		tb, err := findEgressTable(c)
		require.NoError(t, err)
		rules, err := c.GetRules(tb, &nftables.Chain{Name: egressChain, Table: tb})
		require.NoError(t, err)
		var hs []uint64
		for _, r := range rules {
			hs = append(hs, r.Handle)
		}
		return hs
	}
	before := handles()
	require.Len(t, before, 2)
	changed, err = m.program(planEgress([]allocator.Pool{pool}, true, nil))
	require.NoError(t, err)
	require.False(t, changed, "the same plan again changes nothing")

	pool.CIDRs = append(pool.CIDRs, netip.MustParsePrefix("10.99.0.0/24"))
	changed, err = m.program(planEgress([]allocator.Pool{pool}, true, nil))
	require.NoError(t, err)
	require.True(t, changed)
	require.Equal(t, before, handles(), "the rules stay; only the sets changed")
	tb, err := findEgressTable(c)
	require.NoError(t, err)
	set, err := c.GetSetByName(tb, setSrcV4)
	require.NoError(t, err)
	elems, err := c.GetSetElements(set)
	require.NoError(t, err)
	require.True(t, sameElements(intervalElements(ranges("10.42.0.0/16", "10.99.0.0/24"), 4), elems))

	changed, err = m.program(planEgress(nil, true, nil))
	require.NoError(t, err)
	require.True(t, changed)
	tb, err = findEgressTable(c)
	require.NoError(t, err)
	require.Nil(t, tb, "kvipam's table is gone")
	tables, err := c.ListTablesOfFamily(nftables.TableFamilyINet)
	require.NoError(t, err)
	require.Len(t, tables, 1)
	require.Equal(t, other.Name, tables[0].Name, "another's table stays")
	removed, err := RemoveEgress(n.Path())
	require.NoError(t, err, "removing it again is fine")
	require.False(t, removed, "nothing was left to remove")
}

// TestEgressProgramsConcurrently: agents of one process (the tests run
// several) program their namespaces' tables at once without sharing
// state: google/nftables numbers a set from a package-wide counter when
// its ID is left 0, so each set is given its own (run under -race).
func TestEgressProgramsConcurrently(t *testing.T) {
	pool := allocator.Pool{Name: "p", CIDRs: prefixes("10.42.0.0/16", "fd00:42::/64")}
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for range 2 {
		m := nftMasquerader{netns: nstest.NewNS(t).Path()}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 4 {
				p := pool
				p.CIDRs = append(slices.Clone(pool.CIDRs), netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 99, byte(i), 0}), 24))
				if _, err := m.program(planEgress([]allocator.Pool{p}, true, nil)); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
}
