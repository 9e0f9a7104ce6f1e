package cni

import (
	"context"
	"fmt"
	"net/netip"
	"sync"
	"time"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/agent/client"
)

// fakeAgent is an Agent in memory. Each err* field, when set, is what
// that call returns; calls records the calls in order.
type fakeAgent struct {
	mu    sync.Mutex
	calls []string

	cfg    api.Config
	ips    []api.IPConfig
	status api.Status
	eps    map[string]api.Endpoint
	held   map[string][]netip.Prefix

	errWait, errConfig, errAllocate, errEndpoint, errRelease, errStatus, errGC error
	// allocateDown is how many Allocate calls fail as unreachable first,
	// as when the agent restarts.
	allocateDown int
	gcReq        *api.GCRequest
	gcReleased   []string
}

var _ Agent = (*fakeAgent)(nil)

func newFakeAgent() *fakeAgent {
	return &fakeAgent{
		cfg: api.Config{Node: "n1", MTU: 1450, DefaultPool: "default", Pools: []string{"default"}, Datapath: "routes",
			GatewayV4: api.GatewayV4, GatewayV6: api.GatewayV6},
		ips: []api.IPConfig{{Address: netip.MustParsePrefix("10.1.0.5/32"), Family: "ipv4", Gateway: api.GatewayV4, Block: netip.MustParsePrefix("10.1.0.0/26")}},
		status: api.Status{Node: "n1", Ready: true, Restored: true, Etcd: api.EtcdStatus{Reachable: true},
			Lease: api.LeaseStatus{State: "held"}, Pools: []api.PoolStatus{{Pool: "default", Family: "ipv4", Blocks: []netip.Prefix{netip.MustParsePrefix("10.1.0.0/26")}, Capacity: 64, Free: 64}}},
		eps:  map[string]api.Endpoint{},
		held: map[string][]netip.Prefix{},
	}
}

func (f *fakeAgent) record(format string, args ...any) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, fmt.Sprintf(format, args...))
}

func (f *fakeAgent) Calls() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.calls...)
}

func (f *fakeAgent) WaitReady(context.Context) error { f.record("wait"); return f.errWait }

func (f *fakeAgent) Config(context.Context) (*api.Config, error) {
	f.record("config")
	if f.errConfig != nil {
		return nil, f.errConfig
	}
	c := f.cfg
	return &c, nil
}

func (f *fakeAgent) Allocate(_ context.Context, req api.AllocateRequest) (*api.AllocateResponse, error) {
	f.record("allocate %s pool=%q permanent=%v ips=%v ns=%s pod=%s", req.Owner.Key(), req.Pool, req.Permanent, req.IPs, req.Owner.Namespace, req.Owner.Pod)
	if f.errAllocate != nil {
		return nil, f.errAllocate
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.allocateDown > 0 {
		f.allocateDown--
		return nil, unreachable()
	}
	for _, ip := range f.ips {
		f.held[req.Owner.Key()] = append(f.held[req.Owner.Key()], ip.Address)
	}
	exp := time.Now().Add(time.Minute)
	return &api.AllocateResponse{Pool: "default", IPs: f.ips, State: "reserved", Expires: &exp, MTU: f.cfg.MTU}, nil
}

func (f *fakeAgent) CreateEndpoint(_ context.Context, req api.EndpointRequest) (*api.Endpoint, error) {
	f.record("endpoint %s host=%s ips=%v", req.Owner.Key(), req.HostIfName, req.IPs)
	if f.errEndpoint != nil {
		return nil, f.errEndpoint
	}
	ep := api.Endpoint{Owner: req.Owner, HostIfName: req.HostIfName, Datapath: "routes"}
	for _, p := range req.IPs {
		ep.IPs = append(ep.IPs, p.Addr())
	}
	f.mu.Lock()
	f.eps[req.Owner.Key()] = ep
	f.mu.Unlock()
	return &ep, nil
}

// ReleaseAttachment acts as an agent from before ReleaseRequest.HostIfName:
// it leaves the veth to the plugin.
func (f *fakeAgent) ReleaseAttachment(_ context.Context, req api.ReleaseRequest) (*api.ReleaseResponse, error) {
	o := req.Owner
	if req.Sticky != "" {
		f.record("release %s sticky=%s ipClaim=%q ns=%s pod=%s", o.Key(), req.Sticky, req.IPClaim, o.Namespace, o.Pod)
	} else {
		f.record("release %s", o.Key())
	}
	if f.errRelease != nil {
		return nil, f.errRelease
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	out := []string{}
	for _, p := range f.held[o.Key()] {
		out = append(out, p.Addr().String())
	}
	delete(f.held, o.Key())
	delete(f.eps, o.Key())
	return &api.ReleaseResponse{Released: out}, nil
}

func (f *fakeAgent) Endpoints(context.Context) ([]api.Endpoint, error) {
	f.record("endpoints")
	if f.errStatus != nil {
		return nil, f.errStatus
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []api.Endpoint
	for _, ep := range f.eps {
		out = append(out, ep)
	}
	return out, nil
}

func (f *fakeAgent) Allocations(_ context.Context, o api.Owner) ([]api.Allocation, error) {
	f.record("allocations %s", o.Key())
	if f.errStatus != nil {
		return nil, f.errStatus
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []api.Allocation
	for _, a := range f.held[o.Key()] {
		out = append(out, api.Allocation{Pool: "default", Address: a, State: "allocated"})
	}
	return out, nil
}

func (f *fakeAgent) Status(context.Context) (*api.Status, error) {
	f.record("status")
	if f.errStatus != nil {
		return nil, f.errStatus
	}
	st := f.status
	return &st, nil
}

func (f *fakeAgent) GC(_ context.Context, req api.GCRequest) (*api.GCResponse, error) {
	f.record("gc pool=%s valid=%d", req.Pool, len(req.ValidAttachments))
	if f.errGC != nil {
		return nil, f.errGC
	}
	f.gcReq = &req
	return &api.GCResponse{Released: f.gcReleased}, nil
}

// unreachable is what the client returns when the connection to the
// agent breaks (it went away mid-call).
func unreachable() error {
	return fmt.Errorf("POST /v1/... via /run/kvipam/agent.sock: %w: read unix ->/run/kvipam/agent.sock: read: connection reset by peer", client.ErrUnreachable)
}
