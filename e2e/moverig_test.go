package e2e

import (
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"os/exec"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"

	"github.com/kvipam/kvipam/agent/announce"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/testsupport/guestannounce"
)

// A live migration's move as users feel it, on any of the three ways
// pods reach other nodes (host-gw, vxlan, bgp): three dual-stack nodes
// on one segment joined by a router (which runs FRR in bgp mode, the
// nodes then routing every other node's pods through it), the VM's
// launcher pods moving between nodes 1 and 2, KubeVirt's way: a target
// pod added on the other node, the guest's announcement from it (the
// cut-over), the old pod's DEL.

// moveRig is the nodes, the router and the VM of a move.
type moveRig struct {
	t       testing.TB
	routing string // host-gw, vxlan or bgp
	r       *router
	frr     *frr // bgp only
	nodes   []*moveNode
	etcd    string // node 1's embedded etcd, every agent's
	// x is the VM's address of each family; vm the pod that forwards
	// it, and vmNode its node.
	x      [2]netip.Addr
	vm     *pod
	vmNode *moveNode
	pods   int // pods made, for their names
}

// moveNode is a node of the rig: its agent, conflist and node addresses.
type moveNode struct {
	n      *node
	l      *libcni.NetworkConfigList
	v4, v6 netip.Addr
}

// movePool is the rig's dual-stack pool: node 1's first block holds
// the VM's first addresses.
const movePool = "vms=10.12.0.0/24,fd00:12::/112"

// startMoveRig starts the rig with routing, the VM's first pod on node 1.
func startMoveRig(t testing.TB, routing string) *moveRig {
	t.Helper()
	m := &moveRig{t: t, routing: routing, r: newRouter(t)}
	m.r.enable6(t)
	hosts := []int{11, 12, 13}
	if routing == "bgp" {
		var peers []frrPeer
		for _, h := range hosts {
			peers = append(peers, frrPeer{addr: netip.MustParseAddr(fmt.Sprintf("%s.%d", subnetPrefix("A"), h))})
		}
		m.frr = startFRR(t, m.r.ns, frrConf(peers))
	}
	for i, h := range hosts {
		n := newNode(t, fmt.Sprintf("mv%d", i+1))
		mn := &moveNode{n: n, v4: m.r.attach(t, n, "A", h), v6: m.r.attach6(t, n, "A", h)}
		o := agentOpts{pools: []string{movePool}, extra: []string{"--routing", routing, "--node-address", mn.v4.String() + "," + mn.v6.String()}}
		switch routing {
		case "vxlan": // the pods' MTU the overlay's: detected
			o.extra = append(o.extra, "--mtu", "0")
		case "bgp":
			o.bgp = map[string]any{"asn": 65001, "peers": []map[string]any{{"address": subnetPrefix("A") + ".1", "asn": 65000, "holdTime": "9s", "keepaliveTime": "3s"}}}
		}
		// Node 1 runs the embedded etcd (asked for by name) on its
		// underlay address; the others use it.
		if i == 0 {
			m.etcd = "http://" + mn.v4.String() + ":2379"
			o.extra = append(o.extra, "--embedded-etcd-listen", m.etcd)
		} else {
			o.etcdURL = m.etcd
		}
		n.startAgent(o)
		mn.l = n.kvipamList("kv", "1.0.0", `,"capabilities":{"io.kubernetes.cri.pod-annotations":true}`)
		m.nodes = append(m.nodes, mn)
	}
	if m.frr != nil {
		for _, mn := range m.nodes {
			waitFor(t, 60*time.Second, "FRR's session with "+mn.n.name, func() bool { return m.frr.established(mn.v4) })
		}
	}
	m.vm, m.vmNode = m.newVMPod(""), m.nodes[0]
	m.x[0], m.x[1] = podAddrs(t, m.vmNode.n.mustAdd(m.vmNode.l, m.vm))
	require.True(t, m.x[0].IsValid() && m.x[1].IsValid(), "a dual-stack VM")
	return m
}

// newVMPod is a new launcher pod of the VM, the target of migration if
// that is set.
func (m *moveRig) newVMPod(migration string) *pod {
	m.pods++
	return vmPod(m.t, fmt.Sprintf("virt-launcher-vm1-%d", m.pods), migration)
}

// admit adds a migration's target pod on mn: it gets the VM's addresses.
func (m *moveRig) admit(mn *moveNode) *pod {
	m.t.Helper()
	p := m.newVMPod(fmt.Sprintf("kubevirt-migrate-vm1-%d", m.pods+1))
	v4, v6 := podAddrs(m.t, mn.n.mustAdd(mn.l, p))
	require.Equal(m.t, m.x, [2]netip.Addr{v4, v6}, "the migration's target gets the VM's addresses")
	return p
}

// ctl runs kvipamctl against the rig's etcd, from node 1's namespace.
func (m *moveRig) ctl(args ...string) ([]byte, error) {
	var out []byte
	n := m.nodes[0].n
	err := n.do(func() (err error) {
		out, err = exec.Command(n.bin+"/kvipamctl", append(args, "--endpoints", m.etcd)...).CombinedOutput()
		return err
	})
	return out, err
}

// guestMoves returns the move of the guest from the VM's pod to target:
// at one instant the source stops answering (its interface down) and the
// guest, now in target, announces itself as a Linux guest does (a
// gratuitous ARP for its IPv4 address, an unsolicited neighbour
// advertisement for its IPv6 one), which the target's agent sees on the
// target's host veth and cuts over on. The sender is opened beforehand,
// so the move costs two system calls.
func (m *moveRig) guestMoves(target *pod) func() {
	m.t.Helper()
	s, err := guestannounce.NewSender(target.ns.Path(), "eth0")
	require.NoError(m.t, err)
	m.t.Cleanup(func() { _ = s.Close() })
	source := m.vm
	return func() {
		stopAnswering(m.t, source)
		require.NoError(m.t, s.Send(announce.GratuitousARP, m.x[0], nil))
		require.NoError(m.t, s.Send(announce.NeighborAdvert, m.x[1], nil))
	}
}

// stopAnswering takes p's interface down: the guest has left it.
func stopAnswering(t testing.TB, p *pod) {
	t.Helper()
	h := nlHandle(t, p.ns)
	l, err := h.LinkByName("eth0")
	require.NoError(t, err)
	require.NoError(t, h.LinkSetDown(l))
}

// hop is where a namespace's kernel sends one address: out of a
// device, through a gateway or not.
type hop struct {
	oif int
	gw  netip.Addr
}

func (h hop) String() string {
	if h.gw.IsValid() {
		return fmt.Sprintf("via %s dev %d", h.gw, h.oif)
	}
	return fmt.Sprintf("dev %d", h.oif)
}

// routeTo is ns's kernel's route to x (ip route get).
func routeTo(h *netlink.Handle, x netip.Addr) (hop, error) {
	rs, err := h.RouteGet(net.IP(x.AsSlice()))
	if err != nil {
		return hop{}, err
	}
	if len(rs) == 0 {
		return hop{}, fmt.Errorf("no route to %s", x)
	}
	out := hop{oif: rs[0].LinkIndex}
	switch {
	case rs[0].Gw != nil:
		out.gw, _ = netip.AddrFromSlice(rs[0].Gw)
	case rs[0].Via != nil:
		if v, ok := rs[0].Via.(*netlink.Via); ok {
			out.gw, _ = netip.AddrFromSlice(v.Addr)
		}
	}
	out.gw = out.gw.Unmap()
	return out, nil
}

// hostIfIndex is the index of the host end of p's veth (the
// interface its node routes p's addresses through once it forwards).
func hostIfIndex(t testing.TB, p *pod) int {
	t.Helper()
	h := nlHandle(t, p.ns)
	l, err := h.LinkByName("eth0")
	require.NoError(t, err)
	peer := l.Attrs().ParentIndex // a veth's peer index, as the kernel reports it
	require.NotZero(t, peer, "%s's eth0 names its peer", p.name)
	return peer
}

// vtepLinkLocal is the IPv6 link-local address of mn's VXLAN device
// (EUI-64 of its MAC): the gateway of IPv6 routes over an IPv4 underlay.
func vtepLinkLocal(t testing.TB, mn *moveNode) netip.Addr {
	t.Helper()
	l, err := nlHandle(t, mn.n.host).LinkByName("kvipam.vxlan")
	require.NoError(t, err)
	mac := l.Attrs().HardwareAddr
	var b [16]byte
	b[0], b[1] = 0xfe, 0x80
	b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15] = mac[0]^0x02, mac[1], mac[2], 0xff, 0xfe, mac[3], mac[4], mac[5]
	return netip.AddrFrom16(b)
}

// towards says, for each namespace the rig routes in (the nodes, then
// the router in bgp mode), which hop of x means "to the VM's pod p on
// node to": on to itself, p's veth; on another node, a gateway of to
// (host-gw: its node address; vxlan: its VTEP or VXLAN link-local
// address; bgp: the router, which routes to it); on the router, to's
// node address.
func (m *moveRig) towards(to *moveNode, p *pod, x netip.Addr) []func(hop) bool {
	m.t.Helper()
	ifindex := hostIfIndex(m.t, p)
	gws := map[netip.Addr]bool{to.v4: true, to.v6: true}
	switch m.routing {
	case "vxlan":
		gws[vtepLinkLocal(m.t, to)] = true
	case "bgp":
		gws = map[netip.Addr]bool{netip.MustParseAddr(subnetPrefix("A") + ".1"): true, netip.MustParseAddr(rackPrefix6("A") + "1"): true}
	}
	var out []func(hop) bool
	for _, mn := range m.nodes {
		if mn == to {
			out = append(out, func(h hop) bool { return h.oif == ifindex && !h.gw.IsValid() })
			continue
		}
		out = append(out, func(h hop) bool { return gws[h.gw] })
	}
	if m.routing == "bgp" {
		nh := to.v4
		if x.Is6() {
			nh = to.v6
		}
		out = append(out, func(h hop) bool { return h.gw == nh })
	}
	return out
}

// namespaces are the namespaces towards's answers are for, in order.
func (m *moveRig) namespaces() []ns.NetNS {
	var out []ns.NetNS
	for _, mn := range m.nodes {
		out = append(out, mn.n.host)
	}
	if m.routing == "bgp" {
		out = append(out, m.r.ns)
	}
	return out
}

// frrPaths are the next hops of FRR's paths to p (show bgp ... json):
// more than one is two nodes announcing it at once.
func (f *frr) frrPaths(p netip.Prefix) ([]netip.Addr, error) {
	fam := "ipv4"
	if p.Addr().Is6() {
		fam = "ipv6"
	}
	out, err := f.vtysh("show bgp " + fam + " unicast " + p.String() + " json")
	if err != nil {
		return nil, fmt.Errorf("vtysh: %w: %s", err, out)
	}
	// One prefix's paths: bestpath is an object here, not a bool.
	var r struct {
		Paths []struct {
			Valid    bool `json:"valid"`
			Nexthops []struct {
				IP string `json:"ip"`
			} `json:"nexthops"`
		} `json:"paths"`
	}
	if err := json.Unmarshal(out, &r); err != nil {
		return nil, fmt.Errorf("%w: %s", err, out)
	}
	var hops []netip.Addr
	for _, path := range r.Paths {
		if !path.Valid || len(path.Nexthops) == 0 {
			continue
		}
		if a, err := netip.ParseAddr(path.Nexthops[0].IP); err == nil {
			hops = append(hops, a)
		}
	}
	return hops, nil
}

// binding is the VM's sticky binding as kvipamctl claim show prints it.
func (m *moveRig) binding() records.Binding {
	m.t.Helper()
	out, err := m.ctl("claim", "show", "e2e/vm1", "--pool", "vms", "-o", "json")
	require.NoError(m.t, err, "%s", out)
	var rows []records.Binding
	require.NoError(m.t, json.Unmarshal(out, &rows), "%s", out)
	require.Len(m.t, rows, 1)
	return rows[0]
}
