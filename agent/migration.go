package agent

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"syscall"

	"github.com/hashicorp/go-hclog"
	"github.com/vishvananda/netlink"

	"github.com/kvipam/kvipam/agent/announce"
	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/bpf"
	"github.com/kvipam/kvipam/internal/foundation/netlinkns"
)

// Live migration on the node (allocator/records/migration.go says what
// etcd holds). An endpoint is either its addresses' forwarding owner,
// routed on the host through its veth (by the plugin at ADD, by this
// file at a cut-over), or a migration's second owner (api.Endpoint's
// Alternate), to which the host routes nothing: its node routes the
// addresses where the other nodes do, to the forwarding owner's node.
//
// The cut-over happens on the target's node when the guest announces
// itself on the target endpoint's host veth (a gratuitous ARP, an
// unsolicited neighbour advertisement, a RARP: announced); the node's
// watch of bindings follows cut-overs made elsewhere (an operator's
// kvipamctl ip migrate --cut-over, the source pod's DEL handing its
// addresses over) and the source's side of every cut-over. Every other
// node's routes follow the addresses' homes, which the cut-over's
// transaction moved (routing.Peers, the BGP announcer).

// migrationAllocator is what the migration needs of the allocator.
type migrationAllocator interface {
	CutOver(ctx context.Context, pool, identity string, o records.Owner) error
	Learn(ctx context.Context, refs []records.IPRef) error
	BoundRefs(b records.Binding) ([]records.IPRef, error)
}

// migrationEndpoints is what the migration needs of the endpoints.
type migrationEndpoints interface {
	list() []api.Endpoint
	setAlternate(o api.Owner, alt bool, apply func(api.Endpoint) error) (api.Endpoint, bool, error)
}

// guestWatch starts and stops watching a host veth for the guest's
// announcement (announce.Watcher); nil when the node has none.
type guestWatch interface {
	Watch(hostIf string, ifindex int, addrs []netip.Addr) error
	Unwatch(ifindex int) error
}

// migrations is the node's side of live migrations. It is safe for
// concurrent use; its changes to an endpoint are serialized.
type migrations struct {
	node   string
	alloc  migrationAllocator
	eps    migrationEndpoints
	routes hostRoutes
	guest  guestWatch
	log    hclog.Logger

	mu sync.Mutex
	// bindings are the bindings seen, by pool/identity.
	bindings map[string]records.Binding
}

// stickySource is where sticky bindings come from (etcdstore.Store).
type stickySource interface {
	WatchSticky(ctx context.Context, h etcdstore.Handler[records.Binding]) error
}

func (m *migrations) run(ctx context.Context, src stickySource) {
	_ = src.WatchSticky(ctx, migrationWatch{m: m, ctx: ctx})
}

// migrationWatch makes migrations the handler of the watch of bindings.
type migrationWatch struct {
	m   *migrations
	ctx context.Context
}

func (w migrationWatch) Reset(all []records.Binding) {
	w.m.mu.Lock()
	w.m.bindings = map[string]records.Binding{}
	for _, b := range all {
		w.m.bindings[b.Pool+"/"+b.Identity] = b
	}
	w.m.mu.Unlock()
	for _, b := range all {
		w.m.follow(w.ctx, b)
	}
	w.m.watchAlternates()
}

func (w migrationWatch) Put(b records.Binding) {
	w.m.mu.Lock()
	if w.m.bindings == nil {
		w.m.bindings = map[string]records.Binding{}
	}
	w.m.bindings[b.Pool+"/"+b.Identity] = b
	w.m.mu.Unlock()
	w.m.follow(w.ctx, b)
}

func (w migrationWatch) Delete(b records.Binding) {
	w.m.mu.Lock()
	delete(w.m.bindings, b.Pool+"/"+b.Identity)
	w.m.mu.Unlock()
}

// follow brings this node's endpoints of b in line with it: the owner it
// names forwards, its alternate does not.
func (m *migrations) follow(ctx context.Context, b records.Binding) {
	if b.Kept() {
		return
	}
	for _, ep := range m.eps.list() {
		switch {
		case ep.Owner.Key() == b.Owner.Key() && b.Node == m.node && ep.Alternate:
			// Cut over to this node elsewhere (an operator, the source's
			// DEL): the cache learns the addresses, the host routes them.
			m.learn(ctx, b)
			m.forward(ep, b.Identity)
		case b.Alternate != nil && ep.Owner.Key() == b.Alternate.Owner.Key() && b.Alternate.Node == m.node && !ep.Alternate:
			// Cut over away from this node: its pod stops forwarding.
			m.stopForwarding(ep, b)
			m.learn(ctx, b)
		}
	}
}

// learn reads b's addresses back into the allocator's cache.
func (m *migrations) learn(ctx context.Context, b records.Binding) {
	refs, err := m.alloc.BoundRefs(b)
	if err == nil {
		err = m.alloc.Learn(ctx, refs)
	}
	if err != nil {
		m.log.Warn("live migration: cannot read the identity's addresses back; the next write that meets them does", "identity", b.Identity, "error", err)
	}
}

// watchAlternates watches the host veth of every endpoint that is a
// migration's second owner, for its guest's announcement.
func (m *migrations) watchAlternates() {
	for _, ep := range m.eps.list() {
		if ep.Alternate {
			m.watch(ep)
		}
	}
}

// created is told of an endpoint made: a migration's second owner is
// watched for its guest.
func (m *migrations) created(ep api.Endpoint) {
	if ep.Alternate {
		m.watch(ep)
	}
}

func (m *migrations) watch(ep api.Endpoint) {
	if m.guest == nil {
		return
	}
	if err := m.guest.Watch(ep.HostIfName, ep.HostIfIndex, ep.IPs); err != nil {
		m.log.Warn("live migration: cannot watch the target's veth for the guest's announcement; cut over with kvipamctl ip migrate --cut-over",
			"owner", ep.Owner.Key(), "host_if", ep.HostIfName, "error", err)
	}
}

// announced is the guest's announcement seen on host veth ifindex: if
// it is a migration's second owner, the migration cuts over to it.
func (m *migrations) announced(ctx context.Context, ifindex int, what string) {
	for _, ep := range m.eps.list() {
		if ep.HostIfIndex != ifindex || !ep.Alternate {
			continue
		}
		if err := m.cutOver(ctx, ep); err != nil {
			m.log.Warn("live migration: the guest announced itself on the target, and the cut-over failed; the source forwards on",
				"owner", ep.Owner.Key(), "identity", ep.StickyIdentity, "announcement", what, "error", err)
			return
		}
		m.log.Info("live migration: cut over on the guest's announcement", "owner", ep.Owner.Key(), "identity", ep.StickyIdentity,
			"announcement", what, "ips", ep.IPs)
	}
}

// cutOver makes ep, a migration's second owner on this node, the one
// that forwards: one transaction in etcd, then its host routes.
func (m *migrations) cutOver(ctx context.Context, ep api.Endpoint) error {
	if ep.StickyIdentity == "" || ep.Pool == "" {
		return fmt.Errorf("endpoint %s names no sticky identity and pool", ep.Owner.Key())
	}
	if err := m.alloc.CutOver(ctx, ep.Pool, ep.StickyIdentity, ep.Owner); err != nil {
		return err
	}
	m.forward(ep, ep.StickyIdentity)
	return nil
}

// forward routes ep's addresses on the host through its veth and marks
// it forwarding.
func (m *migrations) forward(ep api.Endpoint, identity string) {
	_, changed, err := m.eps.setAlternate(ep.Owner, false, func(ep api.Endpoint) error { return m.routes.add(ep) })
	if err != nil {
		m.log.Error("live migration: cannot route the addresses to the pod that forwards now", "owner", ep.Owner.Key(), "identity", identity, "error", err)
		return
	}
	if changed && m.guest != nil {
		_ = m.guest.Unwatch(ep.HostIfIndex)
	}
}

// stopForwarding takes ep's host routes away: the node routes its
// addresses to the node that forwards now (routing.Peers, from the
// addresses' homes).
func (m *migrations) stopForwarding(ep api.Endpoint, b records.Binding) {
	_, changed, err := m.eps.setAlternate(ep.Owner, true, func(ep api.Endpoint) error { return m.routes.del(ep) })
	if err != nil {
		m.log.Error("live migration: cannot take the host routes from the pod that no longer forwards", "owner", ep.Owner.Key(), "identity", b.Identity, "error", err)
		return
	}
	if changed {
		m.log.Info("live migration: cut over to another node; this node's pod forwards no more", "owner", ep.Owner.Key(), "identity", b.Identity,
			"to", b.Owner.Key(), "to_node", b.Node)
	}
}

// leftForwarding takes ep's host routes away (endpointManager's restore:
// a pod cut over to another node while the agent was down).
func (m *migrations) leftForwarding(ep api.Endpoint) error { return m.routes.del(ep) }

// hostRoutes are the host's routes to pods through their veths, in the
// datapath's network namespace (the plugin makes them at ADD).
type hostRoutes struct{ netns string }

func (r hostRoutes) add(ep api.Endpoint) error {
	return r.each(ep, func(h *netlink.Handle, rt *netlink.Route) error { return h.RouteReplace(rt) })
}

// del deletes ep's routes through its veth only: a route another part
// made (a peer route to the node that forwards now) stays.
func (r hostRoutes) del(ep api.Endpoint) error {
	return r.each(ep, func(h *netlink.Handle, rt *netlink.Route) error {
		if err := h.RouteDel(rt); err != nil && !errors.Is(err, syscall.ESRCH) {
			return err
		}
		return nil
	})
}

func (r hostRoutes) each(ep api.Endpoint, do func(*netlink.Handle, *netlink.Route) error) error {
	h, err := netlinkns.Open(r.netns)
	if err != nil {
		return err
	}
	defer h.Close()
	l, err := h.LinkByName(ep.HostIfName)
	if err != nil {
		return fmt.Errorf("find host interface %q: %w", ep.HostIfName, err)
	}
	for _, a := range ep.IPs {
		rt := &netlink.Route{LinkIndex: l.Attrs().Index, Dst: &net.IPNet{IP: net.IP(a.AsSlice()), Mask: net.CIDRMask(a.BitLen(), a.BitLen())}}
		if a.Is4() {
			rt.Scope = netlink.SCOPE_LINK
		}
		if err := do(h, rt); err != nil {
			return fmt.Errorf("route %s via %s: %w", a, ep.HostIfName, err)
		}
	}
	return nil
}

// openMigrations makes the node's side of live migrations, with the
// watch of guests' announcements, and tells the endpoints of it.
func (a *Agent) openMigrations() {
	a.migrations = &migrations{node: a.cfg.Node, alloc: a.alloc, eps: a.endpoints, routes: hostRoutes{netns: a.cfg.NetNS}, log: a.log.Named("migration")}
	a.guests = openGuestWatch(a.dp, a.cfg.NetNS, a.migrations.log)
	if a.guests != nil {
		a.migrations.guest = a.guests
	}
	a.endpoints.migrations = a.migrations
}

// openGuestWatch opens the watch of guests' announcements for the
// datapath: its eBPF program's, or a packet socket per veth in routes
// mode. Without one, cut-overs come only from operators and DELs.
func openGuestWatch(dp Datapath, netns string, log hclog.Logger) announce.Watcher {
	var bdp *bpf.Datapath
	if b, ok := dp.(*bpfDatapath); ok {
		bdp = b.dp
	}
	w, err := announce.ForDatapath(bdp, netns, log)
	if err != nil {
		log.Warn("live migration: cannot watch for guests' announcements; cut over with kvipamctl ip migrate --cut-over", "error", err)
		return nil
	}
	return w
}

// followGuests cuts over on every guest announcement until ctx ends.
func (a *Agent) followGuests(ctx context.Context) {
	if a.guests == nil {
		return
	}
	for {
		select {
		case <-ctx.Done():
			return
		case ev, ok := <-a.guests.C():
			if !ok {
				return
			}
			cctx, cancel := context.WithTimeout(ctx, a.cfg.RequestTimeout.Duration)
			a.migrations.announced(cctx, ev.HostIfIndex, string(ev.Kind))
			cancel()
		}
	}
}
