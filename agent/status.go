package agent

import (
	"context"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/kvstore"
	"github.com/kvipam/kvipam/routing/bgp"
)

// statusReporter answers GET /v1/status: readiness and why not, etcd, the
// lease, and each pool family's use on this node.
type statusReporter struct {
	node, version, datapath string
	embedded                bool
	etcd                    interface{ Endpoints() []string }
	ready                   readinessState
	probe                   interface{ lastErr() error }
	lease                   interface{ session() *kvstore.Session }
	name                    interface {
		status() (*api.NameTaken, *api.NameContested)
	}
	usage     interface{ Usage() []nodealloc.Usage }
	exhausted *exhaustion
	// bgp, with routing bgp only, is the speaker's state.
	bgp interface {
		Status(ctx context.Context) bgp.Status
	}
}

func (r statusReporter) status() api.Status {
	st := api.Status{Node: r.node, Version: r.version, Datapath: r.datapath}
	err := r.ready.readyErr()
	st.Ready = err == nil
	if err != nil {
		st.Message = err.Error()
	}
	st.Restored = r.ready.isRestored()
	st.NameTaken, st.NameContested = r.name.status()
	etcdErr := r.probe.lastErr()
	st.Etcd = api.EtcdStatus{Reachable: etcdErr == nil, Embedded: r.embedded, Endpoints: r.etcd.Endpoints()}
	if etcdErr != nil {
		st.Etcd.Error = etcdErr.Error()
	}
	st.Lease = api.LeaseStatus{State: "lost"}
	if s := r.lease.session(); s != nil && !s.Lost() {
		st.Lease = api.LeaseStatus{ID: s.ID(), TTL: s.TTL(), State: "held"}
	}
	exhausted := r.exhausted.snapshot()
	for _, u := range r.usage.Usage() {
		ps := api.PoolStatus{Pool: u.Pool, Family: u.Family.String(), Capacity: u.Capacity, Used: u.Used, Reserved: u.Reserved, Free: u.Free,
			Borrowed: u.Borrowed, Lent: u.Lent, Size: u.Size, ReservedRanges: u.ReservedRanges, Disabled: u.Disabled, Refused: u.Refused}
		ps.Blocks = append(ps.Blocks, u.Blocks...)
		ps.ExhaustedReason = exhausted[u.Pool+"/"+u.Family.String()]
		ps.Exhausted = ps.ExhaustedReason != ""
		st.Pools = append(st.Pools, ps)
	}
	if r.bgp != nil {
		bs := r.bgp.Status(context.Background())
		st.BGP = &bs
	}
	return st
}
