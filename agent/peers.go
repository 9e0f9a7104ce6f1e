package agent

import (
	"context"
	"net"
	"net/netip"
	"slices"
	"sync"

	"github.com/hashicorp/go-hclog"
	"github.com/vishvananda/netlink"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/internal/foundation/mirror"
	"github.com/kvipam/kvipam/internal/foundation/netlinkns"
	"github.com/kvipam/kvipam/internal/foundation/syncloop"
)

// routeProtocol marks the routes the agent owns, so it removes only its own.
const routeProtocol = netlink.RouteProtocol(0x6b) // 'k'

// peerRouter routes every other node's blocks to that node: to its
// address (host-gw, nodes on one L2 segment) or through the VXLAN overlay
// (vxlan.go); a routeProgrammer does the kernel's part. It follows the block homes, not
// the claims: a home outlives a claim that expired during a partition, so
// the pods on an orphaned block stay reachable. A node's last known
// address is kept while its node record is gone for the same reason.
type peerRouter struct {
	node   string // this node: its own blocks are not routed
	netns  string // where the routes go; "" is the agent's own
	source peerSource
	prog   routeProgrammer // host-gw or vxlan
	log    hclog.Logger

	owner homesMirror                      // block -> home node
	addrs mirror.Map[string, []netip.Addr] // node -> addresses
	// Until the first full list of both is in, the desired routes are
	// not known, and a sync would delete routes (to every peer whose
	// address is not loaded yet) that the next sync adds back, cutting
	// pod traffic in between.
	loop syncloop.Loop
}

// peerSource is where the peer router learns block homes and node
// addresses (etcdstore.Store).
type peerSource interface {
	WatchHomes(ctx context.Context, h etcdstore.Handler[etcdstore.BlockHome]) error
	WatchNodes(ctx context.Context, h etcdstore.Handler[etcdstore.NodeInfo]) error
}

func newPeerRouter(node, netns string, source peerSource, prog routeProgrammer, log hclog.Logger) *peerRouter {
	p := &peerRouter{node: node, netns: netns, source: source, prog: prog, log: log, loop: syncloop.New("peer routes", log)}
	p.owner.kick = p.loop.Wake()
	return p
}

// run watches homes and node records and keeps the routes in step until
// ctx ends. Its owner (the agent) waits for it.
func (p *peerRouter) run(ctx context.Context) {
	var wg sync.WaitGroup
	wg.Go(func() { _ = p.source.WatchHomes(ctx, &p.owner) })
	wg.Go(func() { _ = p.source.WatchNodes(ctx, nodeWatch{p}) })
	defer wg.Wait()
	p.loop.Run(ctx, func() (bool, error) {
		if !p.listed() {
			return false, nil
		}
		return true, p.sync()
	})
}

// listed reports whether both first lists are in.
func (p *peerRouter) listed() bool {
	_, homes := p.owner.homes.Snapshot()
	_, nodes := p.addrs.Snapshot()
	return homes && nodes
}

func (p *peerRouter) changed() { p.loop.Changed() }

// peerHop is where one other node's block is sent: the node, its
// address of the block's family (invalid if it has none), and all its
// addresses (an overlay picks its tunnel endpoint among them).
type peerHop struct {
	node  string
	addr  netip.Addr
	addrs []netip.Addr
}

// desired is every other node's block with the node's addresses.
func (p *peerRouter) desired() map[netip.Prefix]peerHop {
	owner, _ := p.owner.homes.Snapshot()
	addrs, _ := p.addrs.Snapshot()
	out := map[netip.Prefix]peerHop{}
	for b, node := range owner {
		if node == p.node || len(addrs[node]) == 0 {
			continue
		}
		hop := peerHop{node: node, addrs: addrs[node]}
		for _, a := range addrs[node] {
			if a.Is4() == b.Addr().Is4() {
				hop.addr = a
				break
			}
		}
		out[b] = hop
	}
	return out
}

// sync makes the kernel's peer routes (and what they need) equal the
// desired set, through the routing mode's programmer.
func (p *peerRouter) sync() error {
	h, err := netlinkns.Open(p.netns)
	if err != nil {
		return err
	}
	defer h.Close()
	return p.prog.program(h, p.desired())
}

func prefixNet(p netip.Prefix) *net.IPNet {
	return &net.IPNet{IP: net.IP(p.Addr().AsSlice()), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
}

// nodeWatch learns node addresses from node records; a deleted record
// (lease expired) keeps the last known addresses.
type nodeWatch struct{ p *peerRouter }

func (w nodeWatch) Reset(nodes []etcdstore.NodeInfo) {
	w.p.addrs.Merge(mirror.ByKey(nodes, func(n etcdstore.NodeInfo) (string, []netip.Addr) { return n.Name, n.Addresses }))
	w.p.changed()
}

func (w nodeWatch) Put(n etcdstore.NodeInfo) {
	w.p.addrs.Put(n.Name, n.Addresses)
	w.p.changed()
}

func (nodeWatch) Delete(etcdstore.NodeInfo) {}

// nodeAddresses are the addresses peers route this node's blocks to: the
// configured ones, else, per family, the first global unicast address of
// the link that carries the default route in the datapath's namespace.
func nodeAddresses(configured []string, netnsPath string) []string {
	if len(configured) > 0 {
		return configured
	}
	h, err := netlinkns.Open(netnsPath)
	if err != nil {
		return nil
	}
	defer h.Close()
	var out []string
	for _, fam := range []int{netlink.FAMILY_V4, netlink.FAMILY_V6} {
		routes, err := h.RouteList(nil, fam)
		if err != nil {
			continue
		}
		for _, r := range routes {
			if r.Dst != nil && !r.Dst.IP.IsUnspecified() {
				continue
			}
			l, err := h.LinkByIndex(r.LinkIndex)
			if err != nil {
				continue
			}
			addrs, err := h.AddrList(l, fam)
			if err != nil {
				continue
			}
			if i := slices.IndexFunc(addrs, func(ad netlink.Addr) bool { return ad.IP.IsGlobalUnicast() }); i >= 0 {
				out = append(out, addrs[i].IP.String())
				break
			}
		}
	}
	return out
}
