package cni

import (
	"errors"
	"fmt"
	"net"
	"strings"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// PodVeth is a pod's veth pair made before its addresses are known, so
// that ADD creates it while the agent allocates, with netlink handles in
// the host netns (the calling thread's when it was made) and in the pod's.
// Configure finishes the attachment; Remove deletes the pair; Close
// releases the handles.
//
// Host side, set here: the fixed MAC, proxy ARP (for pods whose neighbour
// entry was flushed) with no delay and, when the host has IPv6, no DAD,
// all before the pod end is up. The host end is created up, which spares
// a burst of ADDs one rtnl operation each, but it has no carrier until its
// peer is up, and the kernel gives it its link-local address only then
// (addrconf waits for the carrier), so that address is never tentative,
// and proxy ARP answers from the pod's first packet on.
//
// Configure adds the pod's addresses with no DAD, the link-scope route to
// the IPv4 gateway, default routes through the gateways and permanent
// neighbour entries for them (the first packet needs no ARP or NDP), and
// on the host a /32 or /128 route per address.
type PodVeth struct {
	podNS     netns.NsHandle
	host, pod *netlink.Handle
	hv        *netlink.Veth
	hostHasV6 bool
}

// CreatePodVeth creates the pair named by s (HostIfName, IfName, Netns,
// MTU; the addresses are not used) with the host end up and the pod end
// down. On error nothing is left behind.
func CreatePodVeth(s PodSpec) (_ *PodVeth, err error) {
	v := &PodVeth{podNS: netns.None(), hostHasV6: ipv6Enabled()}
	defer func() {
		if err != nil {
			v.Close()
		}
	}()
	if v.podNS, err = openNetns(s.Netns); err != nil {
		return nil, err
	}
	if v.host, err = netlink.NewHandle(unix.NETLINK_ROUTE); err != nil {
		return nil, fmt.Errorf("open netlink in the host netns: %w", err)
	}
	if v.pod, err = netlink.NewHandleAt(v.podNS, unix.NETLINK_ROUTE); err != nil {
		return nil, fmt.Errorf("open netlink in netns %s: %w", s.Netns, err)
	}
	if v.hv, err = createVeth(v.host, v.pod, v.podNS, s); err != nil {
		return nil, err
	}
	sysctls := [][2]string{
		{"ipv4/conf/" + s.HostIfName + "/proxy_arp", "1"},
		{"ipv4/neigh/" + s.HostIfName + "/proxy_delay", "0"},
	}
	if v.hostHasV6 {
		sysctls = append(sysctls, [2]string{"ipv6/conf/" + s.HostIfName + "/accept_dad", "0"})
	}
	if s.AcceptLocal {
		sysctls = append(sysctls, [2]string{"ipv4/conf/" + s.HostIfName + "/accept_local", "1"})
	}
	for _, kv := range sysctls {
		if err = setSysctl(kv[0], kv[1]); err != nil {
			err = fmt.Errorf("configure host veth: %w", err)
			return nil, errors.Join(err, v.Remove())
		}
	}
	return v, nil
}

// Configure gives the pair s's addresses, gateways and routes (and s.MTU,
// when the pair has another: each set is an rtnl operation, which a burst
// of ADDs queues on) and waits until both ends are up.
// On error the pair is left for the caller to Remove.
func (v *PodVeth) Configure(s PodSpec) (*PodLinks, error) {
	hasV6 := false
	for _, a := range s.Addrs {
		hasV6 = hasV6 || a.Addr().Is6()
	}
	if hasV6 && !v.hostHasV6 {
		return nil, fmt.Errorf("pod %s needs IPv6 but IPv6 is disabled in the host netns", s.IfName)
	}
	pl, err := v.pod.LinkByName(s.IfName)
	if err != nil {
		return nil, fmt.Errorf("find %s in %s: %w", s.IfName, s.Netns, err)
	}
	if s.MTU != 0 && s.MTU != pl.Attrs().MTU {
		if err := v.host.LinkSetMTU(v.hv, s.MTU); err != nil {
			return nil, fmt.Errorf("set the MTU of %s: %w", s.HostIfName, err)
		}
		if err := v.pod.LinkSetMTU(pl, s.MTU); err != nil {
			return nil, fmt.Errorf("set the MTU of %s in %s: %w", s.IfName, s.Netns, err)
		}
	}
	if hasV6 {
		// The EUI-64 link-local of HostVethMAC is the default gateway;
		// another gateway the agent names must be on the veth too.
		gw := &netlink.Addr{IPNet: hostPrefix(s.GatewayV6, 64), Flags: unix.IFA_F_NODAD}
		if err := v.host.AddrAdd(v.hv, gw); err != nil && !errors.Is(err, unix.EEXIST) {
			return nil, fmt.Errorf("add gateway %s to %s: %w", s.GatewayV6, s.HostIfName, err)
		}
	}
	if err := v.pod.LinkSetUp(pl); err != nil {
		return nil, fmt.Errorf("set %s up in %s: %w", s.IfName, s.Netns, err)
	}
	if err := configurePodAddrs(v.pod, pl, s); err != nil {
		return nil, err
	}
	if err := configurePodRoutes(v.pod, pl, s); err != nil {
		return nil, err
	}
	for _, a := range s.Addrs {
		if s.NoHostRoutes {
			break
		}
		r := &netlink.Route{LinkIndex: v.hv.Attrs().Index, Dst: hostPrefix(a.Addr(), a.Addr().BitLen())}
		if a.Addr().Is4() {
			r.Scope = netlink.SCOPE_LINK
		}
		// Replace: a route left by an old veth of a reused address must
		// not block this pod.
		if err := v.host.RouteReplace(r); err != nil {
			return nil, fmt.Errorf("route %s to %s: %w", a, s.HostIfName, err)
		}
	}
	if err := waitOperUp(v.host, netns.None(), s.HostIfName); err != nil {
		return nil, err
	}
	if err := waitOperUp(v.pod, v.podNS, s.IfName); err != nil {
		return nil, fmt.Errorf("in %s: %w", s.Netns, err)
	}
	return &PodLinks{
		HostIfName: s.HostIfName, HostMAC: v.hv.Attrs().HardwareAddr, HostIfIndex: v.hv.Attrs().Index,
		PodIfName: s.IfName, PodMAC: pl.Attrs().HardwareAddr,
	}, nil
}

// Remove deletes the pair (its pod end and host routes with it).
func (v *PodVeth) Remove() error {
	if err := v.host.LinkDel(v.hv); err != nil && !isNotFound(err) {
		return fmt.Errorf("remove veth %s: %w", v.hv.Attrs().Name, err)
	}
	return nil
}

// Close releases the netlink handles and the netns handle.
func (v *PodVeth) Close() {
	if v.pod != nil {
		v.pod.Close()
	}
	if v.host != nil {
		v.host.Close()
	}
	if v.podNS != netns.None() {
		v.podNS.Close()
	}
}

// createVeth adds the pair with the peer born in the pod netns: ~10x
// cheaper than creating it in the host and moving it. A host veth of the
// same name is a leftover of this same attachment (the name is a hash of
// it), such as one a DEL retired and the agent has not deleted yet (an ADD
// again in the same netns), so it is replaced; if it vanishes meanwhile
// (the agent deleted it), the pair is simply made again.
func createVeth(host, pod *netlink.Handle, podNS netns.NsHandle, s PodSpec) (*netlink.Veth, error) {
	la := netlink.NewLinkAttrs()
	la.Name = s.HostIfName
	la.MTU = s.MTU
	la.HardwareAddr = HostVethMAC
	la.Flags = net.FlagUp // up at once: see PodVeth
	v := &netlink.Veth{LinkAttrs: la, PeerName: s.IfName, PeerNamespace: netlink.NsFd(podNS), PeerTxQLen: -1}
	err := host.LinkAdd(v)
	for try := 0; errors.Is(err, unix.EEXIST) && try < 2; try++ {
		old, lerr := host.LinkByName(s.HostIfName)
		switch {
		case isNotFound(lerr) && try == 0:
			// The pod's interface name is taken: by the pod end of a
			// veth an earlier DEL retired (its pair has gone since, or
			// is deleted now), or by something else.
			if ok, err := removeRetiredPair(host, pod, s.IfName); err != nil || !ok {
				return nil, errors.Join(fmt.Errorf("create veth %s: interface %s already exists in netns %s", s.HostIfName, s.IfName, s.Netns), err)
			}
		case lerr != nil:
			return nil, fmt.Errorf("create veth %s: interface %s already exists in netns %s", s.HostIfName, s.IfName, s.Netns)
		default:
			if derr := host.LinkDel(old); derr != nil && !isNotFound(derr) {
				return nil, fmt.Errorf("remove leftover veth %s: %w", s.HostIfName, derr)
			}
		}
		err = host.LinkAdd(v)
	}
	if err != nil {
		return nil, fmt.Errorf("create veth %s with peer %s in %s: %w", s.HostIfName, s.IfName, s.Netns, err)
	}
	return v, nil
}

// removeRetiredPair deletes the veth whose pod end holds name in the pod
// netns when its host end is one a DEL retired (in api.ReapLinkGroup,
// waiting for the agent to delete it), and reports whether name is free
// now. Anything else holding the name is left alone.
func removeRetiredPair(host, pod *netlink.Handle, name string) (bool, error) {
	pl, err := pod.LinkByName(name)
	if isNotFound(err) {
		return true, nil // deleted meanwhile
	}
	if err != nil {
		return false, fmt.Errorf("find %s in the pod netns: %w", name, err)
	}
	if _, ok := pl.(*netlink.Veth); !ok || pl.Attrs().ParentIndex == 0 {
		return false, nil
	}
	peer, err := host.LinkByIndex(pl.Attrs().ParentIndex)
	if isNotFound(err) {
		return true, nil // the pair is being deleted: gone once LinkAdd runs
	}
	if err != nil {
		return false, fmt.Errorf("find the host end of %s: %w", name, err)
	}
	if peer.Attrs().Group != api.ReapLinkGroup || !strings.HasPrefix(peer.Attrs().Name, HostVethPrefix) {
		return false, nil
	}
	if err := host.LinkDel(peer); err != nil && !isNotFound(err) {
		return false, fmt.Errorf("delete retired veth %s: %w", peer.Attrs().Name, err)
	}
	return true, nil
}
