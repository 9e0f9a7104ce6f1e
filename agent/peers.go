package agent

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/vishvananda/netlink"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/kvstore"
)

// routeProtocol marks the routes the agent owns, so it removes only its own.
const routeProtocol = netlink.RouteProtocol(0x6b) // 'k'

// peerRouter routes every other node's blocks to that node's address
// (flannel's host-gw): with nodes on one L2 segment, pods on different
// nodes reach each other with no overlay. It follows the block homes, not
// the claims: a home outlives a claim that expired during a partition, so
// the pods on an orphaned block stay reachable. A node's last known
// address is kept while its node record is gone for the same reason.
type peerRouter struct {
	a     *Agent
	mu    sync.Mutex
	homes map[string]netip.Prefix // home key -> block
	owner map[netip.Prefix]string // block -> node
	addrs map[string][]netip.Addr // node -> addresses
	kick  chan struct{}
}

func newPeerRouter(a *Agent) *peerRouter {
	return &peerRouter{a: a, homes: map[string]netip.Prefix{}, owner: map[netip.Prefix]string{}, addrs: map[string][]netip.Addr{}, kick: make(chan struct{}, 1)}
}

// run watches homes and node records and keeps the routes in step until
// ctx ends. Its owner (the agent) waits for it.
func (p *peerRouter) run(ctx context.Context) {
	var wg sync.WaitGroup
	for _, w := range []struct {
		prefix string
		h      kvstore.WatchHandler
	}{{etcdstore.Prefix + "homes/", homeWatch{p}}, {etcdstore.NodesPrefix(), nodeWatch{p}}} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				resp, err := p.a.cli.Get(ctx, w.prefix, clientv3.WithPrefix())
				if err == nil {
					w.h.Reset(resp.Kvs, resp.Header.Revision)
					_ = kvstore.Watch(ctx, p.a.cli, w.prefix, resp.Header.Revision+1, w.h)
					continue
				}
				select {
				case <-ctx.Done():
				case <-time.After(time.Second):
				}
			}
		}()
	}
	t := time.NewTicker(30 * time.Second) // repair routes someone else removed
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			wg.Wait()
			return
		case <-p.kick:
		case <-t.C:
		}
		if err := p.sync(); err != nil {
			p.a.log.Warn("peer routes", "error", err)
		}
	}
}

func (p *peerRouter) changed() {
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

// desired is every other node's block with a gateway of its family.
func (p *peerRouter) desired() map[netip.Prefix]netip.Addr {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := map[netip.Prefix]netip.Addr{}
	for b, node := range p.owner {
		if node == p.a.cfg.Node {
			continue
		}
		for _, a := range p.addrs[node] {
			if a.Is4() == b.Addr().Is4() {
				out[b] = a
				break
			}
		}
	}
	return out
}

// sync makes the kernel's kvipam routes equal the desired set.
func (p *peerRouter) sync() error {
	h, err := openNetlink(p.a.cfg.NetNS)
	if err != nil {
		return err
	}
	defer h.Close()
	want := p.desired()
	have, err := h.RouteListFiltered(netlink.FAMILY_ALL, &netlink.Route{Protocol: routeProtocol}, netlink.RT_FILTER_PROTOCOL)
	if err != nil {
		return err
	}
	var errs []error
	for _, r := range have {
		dst, _ := netip.ParsePrefix(r.Dst.String())
		gw, _ := netip.AddrFromSlice(r.Gw)
		if want[dst] == gw.Unmap() {
			delete(want, dst)
			continue
		}
		if err := h.RouteDel(&r); err != nil && !errors.Is(err, syscall.ESRCH) {
			errs = append(errs, err)
		}
	}
	for b, gw := range want {
		r := &netlink.Route{Dst: prefixNet(b), Gw: net.IP(gw.AsSlice()), Protocol: routeProtocol}
		if err := h.RouteReplace(r); err != nil {
			errs = append(errs, err) // a peer not on our segment: no host-gw route to it
			continue
		}
		p.a.log.Debug("route to peer block", "block", b, "via", gw)
	}
	return errors.Join(errs...)
}

func prefixNet(p netip.Prefix) *net.IPNet {
	return &net.IPNet{IP: net.IP(p.Addr().AsSlice()), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
}

// homeWatch mirrors /kvipam/v1/homes/<pool>/<block>.
type homeWatch struct{ p *peerRouter }

func (w homeWatch) Reset(kvs []*mvccpb.KeyValue, _ int64) {
	w.p.mu.Lock()
	clear(w.p.homes)
	clear(w.p.owner)
	w.p.mu.Unlock()
	for _, kv := range kvs {
		w.put(kv)
	}
	w.p.changed()
}

func (w homeWatch) Apply(ev *clientv3.Event) {
	if ev.Type == clientv3.EventTypeDelete {
		w.p.mu.Lock()
		if b, ok := w.p.homes[string(ev.Kv.Key)]; ok {
			delete(w.p.owner, b)
			delete(w.p.homes, string(ev.Kv.Key))
		}
		w.p.mu.Unlock()
	} else {
		w.put(ev.Kv)
	}
	w.p.changed()
}

func (w homeWatch) put(kv *mvccpb.KeyValue) {
	key := string(kv.Key)
	i := strings.LastIndexByte(key, '/')
	b, err := allocator.ParseBlockName(key[i+1:])
	if err != nil {
		return
	}
	var h allocator.Home
	if json.Unmarshal(kv.Value, &h) != nil {
		return
	}
	w.p.mu.Lock()
	w.p.homes[key] = b
	w.p.owner[b] = h.Node
	w.p.mu.Unlock()
}

// nodeWatch learns node addresses from node records; a deleted record
// (lease expired) keeps the last known addresses.
type nodeWatch struct{ p *peerRouter }

func (w nodeWatch) Reset(kvs []*mvccpb.KeyValue, _ int64) {
	for _, kv := range kvs {
		w.put(kv)
	}
	w.p.changed()
}

func (w nodeWatch) Apply(ev *clientv3.Event) {
	if ev.Type != clientv3.EventTypeDelete {
		w.put(ev.Kv)
		w.p.changed()
	}
}

func (w nodeWatch) put(kv *mvccpb.KeyValue) {
	var r etcdstore.NodeRecord
	if json.Unmarshal(kv.Value, &r) != nil {
		return
	}
	var addrs []netip.Addr
	for _, s := range r.Addresses {
		if a, err := netip.ParseAddr(s); err == nil {
			addrs = append(addrs, a)
		}
	}
	w.p.mu.Lock()
	w.p.addrs[strings.TrimPrefix(string(kv.Key), etcdstore.NodesPrefix())] = addrs
	w.p.mu.Unlock()
}

// nodeAddresses are the addresses peers route this node's blocks to: the
// configured ones, else, per family, the first global unicast address of
// the link that carries the default route in the datapath's namespace.
func (a *Agent) nodeAddresses() []string {
	if len(a.cfg.NodeAddresses) > 0 {
		return a.cfg.NodeAddresses
	}
	h, err := openNetlink(a.cfg.NetNS)
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
