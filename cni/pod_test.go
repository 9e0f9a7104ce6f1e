package cni

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/kvipam/kvipam/agent/api"
)

// setupPod is ADD's two pod steps at once, for tests that know the
// addresses already: it creates the veth with its peer directly in the
// pod's netns (CreatePodVeth), configures both ends through netlink
// handles and routes the pod's addresses to the host veth (Configure). It runs in the host's network
// namespace (that of the calling thread). On error it removes the veth,
// so nothing is left behind; the caller still owns the allocation.
func setupPod(s PodSpec) (*PodLinks, error) {
	v, err := CreatePodVeth(s)
	if err != nil {
		return nil, err
	}
	defer v.Close()
	links, err := v.Configure(s)
	if err != nil {
		return nil, errors.Join(err, v.Remove())
	}
	return links, nil
}

func podSpec(pod ns.NetNS, addrs ...string) PodSpec {
	s := PodSpec{
		Netns: pod.Path(), IfName: "eth0", HostIfName: HostVethName("c1", "eth0"), MTU: 1400,
		GatewayV4: api.GatewayV4, GatewayV6: api.GatewayV6,
	}
	for _, a := range addrs {
		s.Addrs = append(s.Addrs, netip.MustParsePrefix(a))
	}
	return s
}

func routeStrings(t *testing.T, h *netlink.Handle, l netlink.Link) []string {
	t.Helper()
	rs, err := h.RouteList(l, netlink.FAMILY_ALL)
	require.NoError(t, err)
	var out []string
	for _, r := range rs {
		dst := prefixOf(r.Dst).String()
		if r.Dst == nil {
			dst = "default"
		}
		if strings.HasPrefix(dst, "fe80::") || r.Table != unix.RT_TABLE_MAIN {
			continue // the kernel's own link-local routes
		}
		s := dst
		if r.Gw != nil {
			s += " via " + r.Gw.String()
		}
		if r.Scope == netlink.SCOPE_LINK {
			s += " scope link"
		}
		out = append(out, s)
	}
	slices.Sort(out)
	return out
}

func TestSetupPodDualStack(t *testing.T) {
	host, pod := newHostNS(t), newNS(t)
	hh, ph := handle(t, host), handle(t, pod)
	s := podSpec(pod, "10.1.0.5/32", "fd00::5/128")

	var links *PodLinks
	require.NoError(t, in(t, host, func() (err error) { links, err = setupPod(s); return err }))
	require.Equal(t, s.HostIfName, links.HostIfName)
	require.Equal(t, HostVethMAC, links.HostMAC)

	hl, err := hh.LinkByName(s.HostIfName)
	require.NoError(t, err)
	require.IsType(t, &netlink.Veth{}, hl)
	require.Equal(t, 1400, hl.Attrs().MTU)
	require.NotZero(t, hl.Attrs().Flags&net.FlagUp)
	require.Equal(t, "1\n", readSysctl(t, host, "ipv4/conf/"+s.HostIfName+"/proxy_arp"))
	require.Equal(t, "0\n", readSysctl(t, host, "ipv4/neigh/"+s.HostIfName+"/proxy_delay"))
	require.Equal(t, "0\n", readSysctl(t, host, "ipv6/conf/"+s.HostIfName+"/accept_dad"))
	require.Equal(t, []string{"10.1.0.5/32 scope link", "fd00::5/128"}, routeStrings(t, hh, hl))
	// The host end is made up before its sysctls are written; its
	// link-local address, the pod's IPv6 gateway, must still never be
	// tentative (it comes with the carrier, after accept_dad=0).
	hostLL, err := hh.AddrList(hl, netlink.FAMILY_V6)
	require.NoError(t, err)
	require.NotEmpty(t, hostLL)
	for _, a := range hostLL {
		require.Zero(t, a.Flags&unix.IFA_F_TENTATIVE, "host veth address %s must be usable at once", a.IPNet)
	}

	pl, err := ph.LinkByName("eth0")
	require.NoError(t, err)
	require.Equal(t, 1400, pl.Attrs().MTU)
	require.Equal(t, links.PodMAC, pl.Attrs().HardwareAddr)
	addrs, err := ph.AddrList(pl, netlink.FAMILY_ALL)
	require.NoError(t, err)
	var got []string
	for _, a := range addrs {
		if !a.IP.IsLinkLocalUnicast() {
			got = append(got, a.IPNet.String())
			require.Zero(t, a.Flags&unix.IFA_F_TENTATIVE, "%s must be usable at once", a.IPNet)
		}
	}
	slices.Sort(got)
	require.Equal(t, []string{"10.1.0.5/32", "fd00::5/128"}, got)
	require.Equal(t, []string{
		"0.0.0.0/0 via 169.254.1.1", "169.254.1.1/32 scope link", "::/0 via fe80::ecee:eeff:feee:eeee",
		"fd00::5/128", // the kernel's prefix route of the /128
	}, routeStrings(t, ph, pl))
	neighs, err := ph.NeighList(pl.Attrs().Index, netlink.FAMILY_ALL)
	require.NoError(t, err)
	perm := 0
	for _, n := range neighs {
		if n.State == netlink.NUD_PERMANENT && n.HardwareAddr.String() == "ee:ee:ee:ee:ee:ee" {
			perm++
		}
	}
	require.Equal(t, 2, perm, "the pod resolves both gateways without ARP or NDP")

	// The pod reaches an address of the host over the veth, both families.
	hostAddr(t, hh, "192.0.2.1/32", "2001:db8::1/128")
	for _, dst := range []string{"192.0.2.1", "2001:db8::1"} {
		requireTCP(t, host, pod, dst)
	}

	require.NoError(t, in(t, host, func() error { return CheckPod(s, links.PodMAC.String(), podRoutes(s)) }))
}

func TestCheckPodFindsWhatIsMissing(t *testing.T) {
	host, pod := newHostNS(t), newNS(t)
	ph := handle(t, pod)
	s := podSpec(pod, "10.1.0.6/32")
	var links *PodLinks
	require.NoError(t, in(t, host, func() (err error) { links, err = setupPod(s); return err }))

	pl, err := ph.LinkByName("eth0")
	require.NoError(t, err)
	_, def, _ := net.ParseCIDR("0.0.0.0/0")
	require.NoError(t, ph.RouteDel(&netlink.Route{LinkIndex: pl.Attrs().Index, Dst: def, Gw: net.ParseIP("169.254.1.1")}))
	require.NoError(t, ph.AddrDel(pl, &netlink.Addr{IPNet: hostPrefix(netip.MustParseAddr("10.1.0.6"), 32)}))

	err = in(t, host, func() error { return CheckPod(s, "02:00:00:00:00:99", podRoutes(s)) })
	require.ErrorContains(t, err, "lost address 10.1.0.6/32")
	require.ErrorContains(t, err, "route 0.0.0.0/0 via 169.254.1.1 is missing")
	require.ErrorContains(t, err, "MAC "+links.PodMAC.String())

	_, err = DeleteHostVethIn(t, host, s.HostIfName)
	require.NoError(t, err)
	err = in(t, host, func() error { return CheckPod(s, "", nil) })
	require.ErrorContains(t, err, "host veth "+s.HostIfName)
}

func TestDeleteHostVethRemovesThePodEndAndRoutes(t *testing.T) {
	host, pod := newHostNS(t), newNS(t)
	hh, ph := handle(t, host), handle(t, pod)
	s := podSpec(pod, "10.1.0.7/32")
	require.NoError(t, in(t, host, func() error { _, err := setupPod(s); return err }))

	removed, err := DeleteHostVethIn(t, host, s.HostIfName)
	require.NoError(t, err)
	require.True(t, removed)
	_, err = ph.LinkByName("eth0")
	require.Error(t, err, "the pod end goes with the host end")
	rs, err := hh.RouteGet(net.ParseIP("10.1.0.7"))
	require.True(t, err != nil || rs[0].LinkIndex == 0, "no route to the pod is left: %v", rs)

	removed, err = DeleteHostVethIn(t, host, s.HostIfName)
	require.NoError(t, err)
	require.False(t, removed, "nothing to delete is not an error")
}

func TestSetupPodFailures(t *testing.T) {
	tests := []struct {
		name     string
		prepare  func(t *testing.T, host, pod ns.NetNS, s *PodSpec)
		wantErr  string
		wantCode uint
	}{
		{
			name:     "netns gone",
			prepare:  func(t *testing.T, _, _ ns.NetNS, s *PodSpec) { s.Netns = t.TempDir() + "/gone" },
			wantErr:  "network namespace not found",
			wantCode: types.ErrInvalidEnvironmentVariables,
		},
		{
			name: "pod already has the interface",
			prepare: func(t *testing.T, _, pod ns.NetNS, s *PodSpec) {
				la := netlink.NewLinkAttrs()
				la.Name = "eth0"
				require.NoError(t, handle(t, pod).LinkAdd(&netlink.Veth{LinkAttrs: la, PeerName: "other0"}))
			},
			wantErr: "interface eth0 already exists",
		},
		{
			name:    "failure after the veth exists removes it",
			prepare: func(_ *testing.T, _, _ ns.NetNS, s *PodSpec) { s.GatewayV4 = netip.Addr{} },
			wantErr: "neighbour",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			host, pod := newHostNS(t), newNS(t)
			s := podSpec(pod, "10.1.0.8/32")
			tt.prepare(t, host, pod, &s)
			err := in(t, host, func() error { _, err := setupPod(s); return err })
			require.ErrorContains(t, err, tt.wantErr)
			if tt.wantCode != 0 {
				require.Equal(t, tt.wantCode, Code(err))
			}
			_, err = handle(t, host).LinkByName(s.HostIfName)
			require.Error(t, err, "no veth is left behind")
		})
	}
}

func TestSetupPodReplacesALeftoverHostVeth(t *testing.T) {
	host, pod := newHostNS(t), newNS(t)
	hh := handle(t, host)
	s := podSpec(pod, "10.1.0.9/32")
	la := netlink.NewLinkAttrs()
	la.Name = s.HostIfName
	require.NoError(t, hh.LinkAdd(&netlink.Veth{LinkAttrs: la, PeerName: "stale0"}))
	require.NoError(t, in(t, host, func() error { _, err := setupPod(s); return err }))
	_, err := hh.LinkByName("stale0")
	require.Error(t, err, "the leftover pair is gone")
}

// TestSetupPodReplacesARetiredPair: the pod's interface name is still held
// by the pod end of a pair an earlier DEL retired (another container ID,
// so another host veth name; the agent has not deleted it yet): ADD
// deletes that pair and goes on. A pair that was not retired is left
// alone, and ADD fails.
func TestSetupPodReplacesARetiredPair(t *testing.T) {
	for _, retired := range []bool{true, false} {
		t.Run(fmt.Sprintf("retired=%v", retired), func(t *testing.T) {
			host, pod := newHostNS(t), newNS(t)
			hh := handle(t, host)
			old := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: HostVethName("c0", "eth0")}, PeerName: "eth0", PeerNamespace: netlink.NsFd(int(pod.Fd()))}
			require.NoError(t, hh.LinkAdd(old))
			if retired {
				require.NoError(t, hh.LinkSetGroup(old, api.ReapLinkGroup))
			}
			s := podSpec(pod, "10.1.0.10/32")
			err := in(t, host, func() error { _, err := setupPod(s); return err })
			_, lerr := hh.LinkByName(old.Name)
			if !retired {
				require.ErrorContains(t, err, "already exists")
				require.NoError(t, lerr, "a pair that was not retired was deleted")
				return
			}
			require.NoError(t, err)
			require.Error(t, lerr, "the retired pair is gone")
			_, err = hh.LinkByName(s.HostIfName)
			require.NoError(t, err)
		})
	}
}

func TestSetupPodEnablesIPv6WhereTheRuntimeDisabledIt(t *testing.T) {
	host, pod := newHostNS(t), newNS(t)
	require.NoError(t, in(t, pod, func() error {
		for _, k := range []string{"all", "default"} {
			if err := setSysctl("ipv6/conf/"+k+"/disable_ipv6", "1"); err != nil {
				return err
			}
		}
		return nil
	}))
	s := podSpec(pod, "fd00::10/128")
	require.NoError(t, in(t, host, func() error { _, err := setupPod(s); return err }))
	require.Equal(t, "0\n", readSysctl(t, pod, "ipv6/conf/eth0/disable_ipv6"))
}

// DeleteHostVethIn runs DeleteHostVeth in n.
func DeleteHostVethIn(t *testing.T, n ns.NetNS, name string) (removed bool, err error) {
	t.Helper()
	err = in(t, n, func() error { removed, err = DeleteHostVeth(name); return err })
	return removed, err
}

// hostAddr puts addresses on lo in the host namespace (this kernel may
// have no dummy links).
func hostAddr(t *testing.T, h *netlink.Handle, addrs ...string) {
	t.Helper()
	d, err := h.LinkByName("lo")
	require.NoError(t, err)
	for _, a := range addrs {
		p := netip.MustParsePrefix(a)
		require.NoError(t, h.AddrAdd(d, &netlink.Addr{IPNet: hostPrefix(p.Addr(), p.Bits()), Flags: unix.IFA_F_NODAD}))
	}
}

// requireTCP connects from the pod to a listener on dst in the host.
func requireTCP(t *testing.T, host, pod ns.NetNS, dst string) {
	t.Helper()
	var ln net.Listener
	require.NoError(t, in(t, host, func() (err error) { ln, err = net.Listen("tcp", net.JoinHostPort(dst, "0")); return err }))
	defer ln.Close()
	go func() {
		c, err := ln.Accept()
		if err == nil {
			_, _ = c.Write([]byte("hi"))
			_ = c.Close()
		}
	}()
	require.NoError(t, in(t, pod, func() error {
		// Now and then (about one run in ten here) the pod's first IPv6
		// connect, right after setupPod, fails with "network is
		// unreachable" while its routes, address and gateway neighbour
		// are all in place, and succeeds a moment later; the kernel's
		// reason is not found yet (docs/cni.md). Retried for up to 2 s.
		c, err := net.Dial("tcp", ln.Addr().String())
		for deadline := time.Now().Add(2 * time.Second); errors.Is(err, unix.ENETUNREACH) && time.Now().Before(deadline); {
			time.Sleep(20 * time.Millisecond)
			c, err = net.Dial("tcp", ln.Addr().String())
		}
		if err != nil {
			return err
		}
		defer c.Close()
		b, err := io.ReadAll(c)
		if err == nil && string(b) != "hi" {
			t.Errorf("read %q", b)
		}
		return err
	}), "pod -> host %s", dst)
}
