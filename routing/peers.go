package routing

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

// Protocol marks the routes routing owns (the routes' protocol, 'k'), so
// it removes only its own.
const Protocol = netlink.RouteProtocol(0x6b) // 'k'

// Peers routes every other node's blocks to that node: to its address
// (host-gw, nodes on one L2 segment) or through the VXLAN overlay
// (vxlan.go); a Programmer does the kernel's part. It follows the block
// homes, not the claims: a home outlives a claim that expired during a
// partition, so the pods on an orphaned block stay reachable. A node's
// last known address is kept while its node record is gone for the same
// reason.
type Peers struct {
	node   string // this node: its own blocks are not routed
	netns  string // where the routes go; "" is the caller's own
	source PeerSource
	prog   Programmer // host-gw or vxlan
	log    hclog.Logger

	owner homesMirror                      // block -> home node
	addrs mirror.Map[string, []netip.Addr] // node -> addresses
	// Until the first full list of both is in, the desired routes are
	// not known, and a sync would delete routes (to every peer whose
	// address is not loaded yet) that the next sync adds back, cutting
	// pod traffic in between.
	loop syncloop.Loop
}

// PeerSource is where the peer router learns block homes and node
// addresses (etcdstore.Store).
type PeerSource interface {
	WatchHomes(ctx context.Context, h etcdstore.Handler[etcdstore.BlockHome]) error
	WatchNodes(ctx context.Context, h etcdstore.Handler[etcdstore.NodeInfo]) error
}

// NewPeers is the peer router of node, programming the routes in the
// network namespace at netns ("" is the caller's) through prog.
func NewPeers(node, netns string, source PeerSource, prog Programmer, log hclog.Logger) *Peers {
	p := &Peers{node: node, netns: netns, source: source, prog: prog, log: log, loop: syncloop.New("peer routes", log)}
	p.owner.kick = p.loop.Wake()
	return p
}

// Run watches homes and node records and keeps the routes in step until
// ctx ends. Its owner (the agent) waits for it.
func (p *Peers) Run(ctx context.Context) {
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
func (p *Peers) listed() bool {
	_, homes := p.owner.homes.Snapshot()
	_, nodes := p.addrs.Snapshot()
	return homes && nodes
}

func (p *Peers) changed() { p.loop.Changed() }

// Passes counts the router's passes (a sync, or a wait for the first
// lists); tests wait on it.
func (p *Peers) Passes() int64 { return p.loop.Passes() }

// peerHop is where one other node's block is sent: the node, its
// address of the block's family (invalid if it has none), and all its
// addresses (an overlay picks its tunnel endpoint among them).
type peerHop struct {
	node  string
	addr  netip.Addr
	addrs []netip.Addr
}

// desired is every other node's block with the node's addresses.
func (p *Peers) desired() map[netip.Prefix]peerHop {
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
func (p *Peers) sync() error {
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
type nodeWatch struct{ p *Peers }

func (w nodeWatch) Reset(nodes []etcdstore.NodeInfo) {
	w.p.addrs.Merge(mirror.ByKey(nodes, func(n etcdstore.NodeInfo) (string, []netip.Addr) { return n.Name, n.Addresses }))
	w.p.changed()
}

func (w nodeWatch) Put(n etcdstore.NodeInfo) {
	w.p.addrs.Put(n.Name, n.Addresses)
	w.p.changed()
}

func (nodeWatch) Delete(etcdstore.NodeInfo) {}

// NodeAddresses are the addresses peers route this node's blocks to: the
// configured ones, else, per family, the first global unicast address of
// the link that carries the default route in the network namespace at
// netnsPath (the datapath's).
func NodeAddresses(configured []string, netnsPath string) []string {
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
		for _, l := range netlinkns.DefaultRouteLinks(h, fam) {
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
