package agent

import (
	"context"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/agent/bgp"
)

// status is the answer to GET /v1/status: readiness and why not, etcd,
// the lease, and each pool family's use on this node.
func (a *Agent) status() api.Status {
	st := api.Status{Node: a.cfg.Node, Version: a.opts.Version, Datapath: a.dp.Name()}
	err := a.readyErr()
	st.Ready = err == nil
	if err != nil {
		st.Message = err.Error()
	}
	st.Restored = a.isRestored()
	etcdErr := a.probe.lastErr()
	st.Etcd = api.EtcdStatus{Reachable: etcdErr == nil, Embedded: a.embedded != nil, Endpoints: a.cli.Endpoints()}
	if etcdErr != nil {
		st.Etcd.Error = etcdErr.Error()
	}
	st.Lease = api.LeaseStatus{State: "lost"}
	if s := a.lease.session(); s != nil && !s.Lost() {
		st.Lease = api.LeaseStatus{ID: s.ID(), TTL: s.TTL(), State: "held"}
	}
	exhausted := a.exhausted.snapshot()
	for _, u := range a.alloc.Usage() {
		ps := api.PoolStatus{Pool: u.Pool, Family: u.Family.String(), Capacity: u.Capacity, Used: u.Used, Reserved: u.Reserved, Free: u.Free,
			Borrowed: u.Borrowed, Lent: u.Lent, Size: u.Size, ReservedRanges: u.ReservedRanges, Disabled: u.Disabled}
		ps.Blocks = append(ps.Blocks, u.Blocks...)
		ps.ExhaustedReason = exhausted[u.Pool+"/"+u.Family.String()]
		ps.Exhausted = ps.ExhaustedReason != ""
		st.Pools = append(st.Pools, ps)
	}
	if a.speaker != nil {
		st.BGP = bgpStatus(a.speaker.Status(context.Background()))
	}
	return st
}

func bgpStatus(s bgp.Status) *api.BGPStatus {
	out := &api.BGPStatus{ASN: s.ASN, Announced: s.Announced, Error: s.Error}
	for _, p := range s.Peers {
		out.Peers = append(out.Peers, api.BGPPeerStatus{Address: p.Address, ASN: p.ASN, State: p.State, Advertised: p.Advertised, Received: p.Received, Uptime: p.Uptime})
	}
	return out
}
