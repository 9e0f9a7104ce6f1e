package agent

import (
	"context"
	"net/netip"
	"strings"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/nodealloc"
)

// Endpoints whose allocation etcd lost. etcd restored from an older
// snapshot no longer has the allocations made after it, while their pods
// still run. The agent compares its endpoints with etcd (not with its
// cache, which still remembers them) after every restore of its lease, on
// every reconciler pass, and as soon as etcd answers again after being
// unreachable. The allocator writes back each missing allocation whose
// address is in a block this node holds the claim on (fenced by that
// claim) and reports the rest: an address another owner holds now, or in
// a block that is not this node's. Those are reported like lost endpoints
// (a warning, kvipam_endpoints_lost, the node record's lostEndpoints that
// kvipamctl check lists); nothing is written for them, and the pods should
// be deleted. Until then the allocator never hands out an address an
// endpoint uses (nodealloc.Config.Held).

// verify runs reassert over every endpoint, reporting conflicts.
func (m *endpointManager) verify(ctx context.Context) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.reassert(ctx, m.records.list(), true)
}

// reassert re-asserts eps' missing allocations; with report, it also
// reports the conflicts as lost endpoints. The caller holds m.mu.
func (m *endpointManager) reassert(ctx context.Context, eps []api.Endpoint, report bool) {
	var held []nodealloc.HeldAddr
	byOwner := map[string]api.Endpoint{}
	for _, ep := range eps {
		if ep.Alternate {
			continue // a live migration's second owner: no record of its own to write back
		}
		byOwner[ep.Owner.Key()] = ep
		for _, ip := range ep.IPs {
			if ip.IsValid() {
				held = append(held, nodealloc.HeldAddr{Owner: ep.Owner, Addr: ip.Unmap(), Identity: ep.StickyIdentity, WindowSeconds: ep.StickyWindowSeconds})
			}
		}
	}
	if len(held) == 0 {
		return
	}
	restored, conflicts, err := m.alloc.Reassert(ctx, held)
	if err != nil {
		m.log.Warn("cannot compare the endpoints with etcd; trying again later", "error", err)
	}
	for _, al := range restored {
		m.log.Warn("etcd had lost the allocation of a running endpoint: written back", "owner", al.Owner.Key(),
			"pod", al.Namespace+"/"+al.Pod, "pool", al.Pool, "ip", al.Addr)
		if m.reasserted != nil {
			m.reasserted.Inc()
		}
	}
	if !report || len(conflicts) == 0 {
		return
	}
	gone := map[string][]netip.Addr{}
	reasons := map[string][]string{}
	for _, c := range conflicts {
		gone[c.Owner.Key()] = append(gone[c.Owner.Key()], c.Addr)
		reasons[c.Owner.Key()] = append(reasons[c.Owner.Key()], c.Addr.String()+": "+c.Reason)
		m.log.Warn("an endpoint's address cannot be re-asserted in etcd; delete the pod", "owner", c.Owner.Key(),
			"pod", c.Owner.Namespace+"/"+c.Owner.Pod, "ip", c.Addr, "reason", c.Reason)
	}
	var lost []etcdstore.LostEndpoint
	for k, addrs := range gone {
		le := m.lostEndpoint(ctx, byOwner[k], addrs)
		le.Kept = true // still running: only deleting the pod fixes it
		le.Reason = strings.Join(reasons[k], "; ")
		lost = append(lost, le)
	}
	if m.lost != nil {
		m.lost.reportLost(ctx, lost)
	}
}
