package agent

import (
	"context"
	"fmt"
	"net/http"
	"net/netip"
	"slices"
	"time"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
)

// handlers are the API's routes as domain calls: each takes a decoded,
// checked request and returns an answer or a domain error; apiServer does
// the HTTP around them.
type handlers struct {
	node        string
	labels      map[string]string // the node's
	pools       poolSet
	defaultPool string
	bindings    poolBinder
	podMTU      int
	datapath    string
	resTTL      time.Duration

	alloc     requestAllocator
	exhausted *exhaustion
	endpoints interface {
		create(ctx context.Context, req api.EndpointRequest) (api.Endpoint, error)
		release(ctx context.Context, o api.Owner, hostIf, identity string) ([]string, string, error)
		list() []api.Endpoint
	}
	counters counterSource
	garbage  gcCollector
	owners   ownerLookup
	reporter statusSource
}

// poolSet is the pools the node knows, as etcd has them (the allocator).
type poolSet interface {
	// Pools are every pool in etcd (and a deleted one until its addresses go).
	Pools() []allocator.Pool
	// Serves says whether the node takes new addresses in pool.
	Serves(pool string) bool
	// Restored says whether the pools are read: until then the
	// allocator answers every request with try-again.
	Restored() bool
}

// spec is the pool's spec as etcd has it, if etcd has the pool.
func (h *handlers) spec(pool string) (allocator.Pool, bool) {
	ps := h.pools.Pools()
	i := slices.IndexFunc(ps, func(p allocator.Pool) bool { return p.Name == pool })
	if i < 0 {
		return allocator.Pool{}, false
	}
	return ps[i], true
}

// known reports whether pool is one of etcd's (or the pools are not read
// yet, and the allocator will say try again).
func (h *handlers) known(pool string) bool {
	_, ok := h.spec(pool)
	return ok || !h.pools.Restored()
}

// poolForRequest is the pool of a request that names none: the
// configured default, else the one pool that serves this node, where a
// pool whose node selector chose the node (its rack's, its zone's) comes
// before a pool for every node; "" when that leaves none or several.
func (h *handlers) poolForRequest() string {
	if h.defaultPool != "" {
		return h.defaultPool
	}
	var chosen, all []string
	for _, p := range h.pools.Pools() {
		if !h.pools.Serves(p.Name) {
			continue
		}
		all = append(all, p.Name)
		if p.NodeSelector != "" {
			chosen = append(chosen, p.Name)
		}
	}
	switch {
	case len(chosen) == 1:
		return chosen[0]
	case len(chosen) == 0 && len(all) == 1:
		return all[0]
	}
	return ""
}

// poolBinder says which pool a namespace is bound to ("" for none).
type poolBinder interface{ poolFor(ns string) string }

// requestAllocator serves one allocate request.
type requestAllocator interface {
	Allocate(ctx context.Context, req nodealloc.Request) (nodealloc.Result, error)
	// Admit admits a live migration's target (nodealloc.Allocator.Admit).
	Admit(ctx context.Context, req nodealloc.Request) (nodealloc.Result, bool, error)
}

// counterSource reads the datapath's per-endpoint counters.
type counterSource interface {
	Counters() (map[uint32]api.Counters, error)
}

// gcCollector serves a CNI GC request.
type gcCollector interface {
	collect(ctx context.Context, req api.GCRequest, now time.Time) (api.GCResponse, error)
}

// ownerLookup says what an owner holds on this node.
type ownerLookup interface {
	Lookup(o records.Owner) []records.Allocation
}

// statusSource is the agent's status.
type statusSource interface{ status() api.Status }

func (h *handlers) health(context.Context, struct{}) (map[string]string, error) {
	return map[string]string{"status": "ok"}, nil
}

func (h *handlers) status(context.Context, struct{}) (api.Status, error) {
	return h.reporter.status(), nil
}

func (h *handlers) config(context.Context, struct{}) (api.Config, error) {
	var pools []string
	for _, p := range h.pools.Pools() {
		if h.pools.Serves(p.Name) {
			pools = append(pools, p.Name)
		}
	}
	return api.Config{
		Node: h.node, MTU: h.podMTU, DefaultPool: h.poolForRequest(), Pools: pools,
		Datapath: h.datapath, GatewayV4: api.GatewayV4, GatewayV6: api.GatewayV6,
		ReservationTTL: h.resTTL.String(),
	}, nil
}

// checkAllocate names the field at fault in an allocate request.
func (h *handlers) checkAllocate(req api.AllocateRequest) error {
	_, err := h.toRequest(req)
	return err
}

func (h *handlers) allocate(ctx context.Context, req api.AllocateRequest) (api.AllocateResponse, error) {
	areq, err := h.toRequest(req)
	if err != nil {
		return api.AllocateResponse{}, err
	}
	if areq.Migration != "" {
		// A live migration's target: admitted as the identity's second
		// owner while another pod holds it; else an ordinary takeover.
		res, ok, err := h.alloc.Admit(ctx, areq)
		if err != nil {
			return api.AllocateResponse{}, err
		}
		if ok {
			return h.allocateResponse(res), nil
		}
	}
	res, err := h.alloc.Allocate(ctx, areq)
	h.exhausted.note(areq, err)
	if err != nil {
		return api.AllocateResponse{}, err
	}
	return h.allocateResponse(res), nil
}

// toRequest validates an allocate request, naming the field at fault.
func (h *handlers) toRequest(req api.AllocateRequest) (nodealloc.Request, error) {
	if err := validOwner(req.Owner); err != nil {
		return nodealloc.Request{}, err
	}
	out := nodealloc.Request{Owner: req.Owner, Reserve: !req.Permanent}
	field, from := "podPool", "the pod's annotation kvipam.io/pool"
	var bound string
	if h.bindings != nil {
		bound = h.bindings.poolFor(req.Owner.Namespace)
	}
	switch {
	case req.PodPool != "":
		out.Pool = req.PodPool
	case bound != "":
		out.Pool = bound
		field, from = "owner.namespace", "namespace "+req.Owner.Namespace+"'s binding (kvipamctl pool bind-namespace)"
	case req.Pool != "":
		out.Pool = req.Pool
		field, from = "pool", "the network configuration"
	default:
		out.Pool = h.poolForRequest()
		field, from = "pool", "the agent's default pool"
	}
	held := h.heldPool(out.Owner, out.Pool)
	if held != "" {
		// A retried ADD: the choice may have changed since the first try
		// (a namespace rebound, an annotation edited), but the attachment
		// is the same, and it gets what landed, not a second address.
		out.Pool = held
	}
	pod := req.Owner.Key()
	if req.Owner.Pod != "" {
		pod = req.Owner.Namespace + "/" + req.Owner.Pod
	}
	switch p, ok := h.spec(out.Pool); {
	case out.Pool == "" && h.pools.Restored():
		return out, &FieldError{Field: field, Msg: fmt.Sprintf("pod %s: no pool named, and node %s has no default pool: it is served by no pool, or by several (none or several of them chosen by a node selector); set defaultPool, or name a pool", pod, h.node)}
	case !h.known(out.Pool):
		return out, &FieldError{Field: field, Msg: fmt.Sprintf("pod %s: pool %q (from %s) is not served by node %s: etcd has no such pool (kvipamctl pool list)", pod, out.Pool, from, h.node)}
	case ok && held == "" && req.Sticky == "" && !p.Selects(h.labels):
		// A sticky request goes on to the allocator, which refuses it
		// too (records.ErrNodeNotSelected), naming the addresses the
		// identity has in the pool, if any.
		labels := allocator.FormatLabels(h.labels)
		if labels == "" {
			labels = "none"
		}
		return out, &FieldError{Field: field, Msg: fmt.Sprintf("pod %s: pool %q (from %s) is not served by node %s: its node selector %q does not choose the node's labels (%s); kvipamctl pool show %s lists the nodes it serves",
			pod, out.Pool, from, h.node, p.NodeSelector, labels, out.Pool)}
	}
	for i, f := range req.Families {
		fam, err := allocator.ParseFamily(f)
		if err != nil {
			return out, &FieldError{Field: fmt.Sprintf("families[%d]", i), Msg: err.Error()}
		}
		out.Families = append(out.Families, fam)
	}
	out.IPs = req.IPs // decoding refused a malformed one, naming it
	if req.Sticky != "" {
		s, err := stickyOf(req.Owner, req.Sticky, req.IPClaim)
		if err != nil {
			return out, err
		}
		out.Sticky = s
	}
	if req.Migration != "" {
		if out.Sticky == nil {
			return out, &FieldError{Field: "migration", Msg: "a live migration's target needs a sticky identity (sticky, and ipClaim or the pod's name): only a sticky identity's addresses follow a VM"}
		}
		out.Migration = req.Migration
	}
	return out, nil
}

// heldPool is the pool in which the owner already holds addresses on
// this node, or "": want when it holds some there too.
func (h *handlers) heldPool(o records.Owner, want string) string {
	if h.owners == nil {
		return ""
	}
	held := ""
	for _, al := range h.owners.Lookup(o) {
		if al.Pool == want {
			return want
		}
		if held == "" {
			held = al.Pool
		}
	}
	return held
}

// stickyOf is the sticky identity a request asks for or names: owner's
// namespace and its ipClaim, else its pod's name, kept for the window
// sticky.
func stickyOf(owner api.Owner, sticky, ipClaim string) (*records.Sticky, error) {
	d, err := time.ParseDuration(sticky)
	if err != nil {
		return nil, &FieldError{Field: "sticky", Msg: fmt.Sprintf("sticky %q is not a duration (e.g. 10m)", sticky)}
	}
	name := ipClaim
	if name == "" {
		name = owner.Pod
	}
	if owner.Namespace == "" || name == "" {
		return nil, &FieldError{Field: "sticky", Msg: "a sticky identity needs the pod's namespace and name (K8S_POD_NAMESPACE, K8S_POD_NAME) or an ip-claim"}
	}
	s := &records.Sticky{Identity: owner.Namespace + "/" + name, Window: d}
	if err := s.Validate(); err != nil {
		return nil, &FieldError{Field: "sticky", Msg: err.Error()}
	}
	return s, nil
}

func (h *handlers) allocateResponse(res nodealloc.Result) api.AllocateResponse {
	out := api.AllocateResponse{Pool: res.Pool, MTU: h.podMTU, State: string(records.StateAllocated), Alternate: res.Alternate}
	for _, al := range res.Allocations {
		gw := api.GatewayV4
		if al.Addr.Is6() {
			gw = api.GatewayV6
		}
		out.IPs = append(out.IPs, api.IPConfig{
			Address: netip.PrefixFrom(al.Addr, al.Addr.BitLen()), Family: allocator.FamilyOf(al.Addr).String(),
			Gateway: gw, Block: al.Block,
		})
		if al.State == records.StateReserved {
			out.State = string(records.StateReserved)
		}
	}
	if !res.Expires.IsZero() && out.State == string(records.StateReserved) {
		exp := res.Expires.UTC()
		out.Expires = &exp
	}
	return out
}

func checkRelease(req api.ReleaseRequest) error { return validOwner(req.Owner) }

func (h *handlers) release(ctx context.Context, req api.ReleaseRequest) (api.ReleaseResponse, error) {
	var identity string
	if req.Sticky != "" {
		s, err := stickyOf(req.Owner, req.Sticky, req.IPClaim)
		if err != nil {
			return api.ReleaseResponse{}, err
		}
		identity = s.Identity
	}
	released, hostIf, err := h.endpoints.release(ctx, req.Owner, req.HostIfName, identity)
	if err != nil {
		return api.ReleaseResponse{}, err
	}
	return api.ReleaseResponse{Released: released, HostIf: hostIf}, nil
}

func checkEndpoint(req api.EndpointRequest) error {
	if err := validOwner(req.Owner); err != nil {
		return err
	}
	if req.HostIfName == "" || len(req.HostIfName) > 15 {
		return &FieldError{Field: "hostIfName", Msg: fmt.Sprintf("hostIfName %q is not a valid interface name", req.HostIfName)}
	}
	return nil
}

func (h *handlers) createEndpoint(ctx context.Context, req api.EndpointRequest) (api.Endpoint, error) {
	return h.endpoints.create(ctx, req)
}

// listQuery is GET /v1/endpoints?stats=1.
type listQuery struct{ stats bool }

func statsQuery(_ http.ResponseWriter, r *http.Request) (listQuery, error) {
	return listQuery{stats: r.URL.Query().Get("stats") != ""}, nil
}

func (h *handlers) listEndpoints(_ context.Context, q listQuery) (api.EndpointList, error) {
	eps := h.endpoints.list()
	if q.stats {
		counters, err := h.counters.Counters()
		if err != nil {
			return api.EndpointList{}, fmt.Errorf("read datapath counters: %w", err)
		}
		for i := range eps {
			if c, ok := counters[eps[i].ID]; ok {
				eps[i].Counters = &c
			}
		}
	}
	return api.EndpointList{Endpoints: eps}, nil
}

func (h *handlers) checkGC(req api.GCRequest) error {
	if req.Pool != "" && !h.known(req.Pool) {
		return &FieldError{Field: "pool", Msg: fmt.Sprintf("pool %q is not served by node %s", req.Pool, h.node)}
	}
	for i, at := range req.ValidAttachments {
		if at.ContainerID == "" || at.IfName == "" {
			return &FieldError{Field: fmt.Sprintf("validAttachments[%d]", i), Msg: "an attachment needs containerID and ifname"}
		}
	}
	return nil
}

func (h *handlers) gc(ctx context.Context, req api.GCRequest) (api.GCResponse, error) {
	return h.garbage.collect(ctx, req, time.Now())
}

func (h *handlers) allocations(_ context.Context, o api.Owner) (api.AllocationList, error) {
	out := api.AllocationList{Allocations: []api.Allocation{}}
	for _, al := range h.owners.Lookup(o) {
		out.Allocations = append(out.Allocations, api.Allocation{
			Pool: al.Pool, Address: netip.PrefixFrom(al.Addr, al.Addr.BitLen()), Block: al.Block, State: string(al.State),
		})
	}
	return out, nil
}
