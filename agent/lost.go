package agent

import (
	"context"
	"net/netip"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/kvstore"
	"github.com/prometheus/client_golang/prometheus"
)

// Lost endpoints. A node that was away (down, or cut off from etcd for
// longer than its lease) may come back to find that an operator freed its
// blocks with kvipamctl node remove, and that another node has claimed
// them and handed the addresses to its own pods. The allocator then holds
// nothing for those owners: Restore re-claims only blocks whose home is
// still this node, and never writes an allocation, so the node cannot take
// an address back. What is left is this node's pods, which may still run
// with addresses that are someone else's now. The agent cannot fix that
// (only deleting those pods can), so it makes it loud: a warning naming
// each address and who holds it now, the kvipam_endpoints_lost gauge, and
// the node record's lostEndpoints, which kvipamctl check reports.

// checkEndpoints returns the endpoints of eps whose owner still holds an
// address after a restore. An endpoint with an address its owner no longer
// holds is reported; one whose owner holds none of its addresses is torn
// down (its record is removed), as it can no longer be served. The caller
// holds m.mu.
func (m *endpointManager) checkEndpoints(ctx context.Context, eps []api.Endpoint) []api.Endpoint {
	// First write back what etcd lost and may be re-asserted (reassert.go);
	// what cannot be is judged below from the allocator's view.
	m.reassert(ctx, eps, false)
	var keep []api.Endpoint
	var lost []etcdstore.LostEndpoint
	for _, ep := range eps {
		if ep.Alternate {
			// A live migration's second owner holds no record of its
			// own: the migration's watch of bindings checks it
			// (migration.go).
			keep = append(keep, ep)
			continue
		}
		held := m.alloc.Lookup(ep.Owner)
		if len(held) == 0 && ep.StickyIdentity != "" && m.migratedAway(ctx, ep) {
			keep = append(keep, ep)
			continue
		}
		mine := map[netip.Addr]bool{}
		for _, al := range held {
			mine[al.Addr] = true
		}
		var gone []netip.Addr
		for _, addr := range ep.IPs {
			if addr.IsValid() && !mine[addr.Unmap()] {
				gone = append(gone, addr.Unmap())
			}
		}
		if len(held) > 0 {
			keep = append(keep, ep)
		}
		if len(gone) == 0 && len(held) > 0 {
			continue
		}
		le := m.lostEndpoint(ctx, ep, gone)
		le.Kept = len(held) > 0
		lost = append(lost, le)
		holders := make([]string, len(le.IPs))
		for i, ip := range le.IPs {
			holders[i] = ip.IP + " held by " + ip.Holder()
		}
		action := "endpoint removed"
		if le.Kept {
			action = "endpoint kept for its other addresses"
		}
		m.log.Warn("endpoint lost its addresses while this node was away; they are not taken back, delete the pod",
			"owner", le.Owner, "pod", le.Namespace+"/"+le.Pod, "ips", holders, "action", action)
		if !le.Kept {
			_ = m.dp.Teardown(ctx, ep)
			_ = m.records.remove(ep.Owner)
		}
	}
	if len(lost) > 0 && m.lost != nil {
		m.lost.reportLost(ctx, lost)
	}
	return keep
}

// migratedAway reports whether ep's owner, which holds none of its
// addresses, is their live migration's second owner: cut over to
// another node while this agent was down. Its endpoint stays, marked so
// and without its host routes (migration.go), for its pod's DEL.
func (m *endpointManager) migratedAway(ctx context.Context, ep api.Endpoint) bool {
	if m.holders == nil || m.migrations == nil || len(ep.IPs) == 0 {
		return false
	}
	_, al, err := m.holders.holder(ctx, ep.IPs[0].Unmap())
	if err != nil || al == nil || al.Alternate == nil || al.Alternate.Owner.Key() != ep.Owner.Key() {
		return false
	}
	if err := m.migrations.leftForwarding(ep); err != nil {
		m.log.Warn("live migration: cannot take the host routes from a pod cut over to another node while the agent was down", "owner", ep.Owner.Key(), "error", err)
	}
	ep.Alternate = true
	if err := m.records.put(ep); err != nil {
		m.log.Warn("cannot save an endpoint record", "owner", ep.Owner.Key(), "error", err)
	}
	m.log.Info("live migration: cut over to another node while the agent was down; this pod forwards no more", "owner", ep.Owner.Key(),
		"identity", ep.StickyIdentity, "forwarding_node", al.Node)
	return true
}

// lostEndpoint describes ep with its lost addresses and, read from etcd,
// who holds each one now.
func (m *endpointManager) lostEndpoint(ctx context.Context, ep api.Endpoint, gone []netip.Addr) etcdstore.LostEndpoint {
	le := etcdstore.LostEndpoint{Owner: ep.Owner.Key(), Namespace: ep.Owner.Namespace, Pod: ep.Owner.Pod,
		IPs: []etcdstore.LostIP{}, FoundAt: time.Now().UTC()}
	for _, addr := range gone {
		ip := etcdstore.LostIP{IP: addr.String(), Unknown: true}
		pool, al, err := m.holders.holder(ctx, addr)
		switch {
		case err != nil:
			m.log.Warn("cannot read who holds a lost address", "ip", addr, "error", err)
		case pool != "":
			ip.Pool, ip.Unknown = pool, false
			if al != nil {
				ip.HeldBy, ip.HeldByNode = al.Owner.Key(), al.Node
			}
		}
		le.IPs = append(le.IPs, ip)
	}
	return le
}

// poolHolders finds who holds an address of the node's pools in etcd.
type poolHolders struct {
	pools interface{ Pools() []allocator.Pool }
	store interface {
		Holder(ctx context.Context, p allocator.Pool, addr netip.Addr) (*records.Allocation, error)
	}
}

// holder finds the pool of addr and who holds it in etcd now.
func (h poolHolders) holder(ctx context.Context, addr netip.Addr) (string, *records.Allocation, error) {
	for _, p := range h.pools.Pools() {
		if p.Contains(addr) {
			al, err := h.store.Holder(ctx, p, addr)
			return p.Name, al, err
		}
	}
	return "", nil, nil
}

// lostReports publishes endpoints found lost: the gauge, and the node
// record rewritten on the current lease (a later lease's record carries
// them too).
type lostReports struct {
	recorder *nodeRecorder
	gauge    prometheus.Gauge
	lease    interface{ session() *kvstore.Session }
	log      hclog.Logger
}

func (r lostReports) reportLost(ctx context.Context, lost []etcdstore.LostEndpoint) {
	n, changed := r.recorder.addLost(lost)
	r.gauge.Set(float64(n))
	sess := r.lease.session()
	if sess == nil || !changed {
		return
	}
	if err := r.recorder.write(ctx, sess.ID()); err != nil {
		r.log.Warn("cannot list lost endpoints in the node record", "error", err)
	}
}
