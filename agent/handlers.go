package agent

import (
	"errors"
	"fmt"
	"maps"
	"net/http"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/allocator"
)

func (a *Agent) handleHealth(w http.ResponseWriter, r *http.Request) {
	if err := a.readyErr(); err != nil {
		a.writeError(w, r, tryAgain(err))
		return
	}
	a.writeJSON(w, r, http.StatusOK, map[string]string{"status": "ok"})
}

func (a *Agent) handleStatus(w http.ResponseWriter, r *http.Request) {
	a.writeJSON(w, r, http.StatusOK, a.status())
}

func (a *Agent) status() api.Status {
	st := api.Status{Node: a.cfg.Node, Version: a.opts.Version, Datapath: a.dp.Name()}
	err := a.readyErr()
	st.Ready = err == nil
	if err != nil {
		st.Message = err.Error()
	}
	a.mu.Lock()
	st.Restored = a.restored
	st.Etcd = api.EtcdStatus{Reachable: a.etcdErr == nil, Embedded: a.embedded != nil, Endpoints: a.cli.Endpoints()}
	if a.etcdErr != nil {
		st.Etcd.Error = a.etcdErr.Error()
	}
	st.Lease = api.LeaseStatus{State: "lost"}
	if a.sess != nil && !a.sess.Lost() {
		st.Lease = api.LeaseStatus{ID: a.sess.ID(), TTL: a.sess.TTL(), State: "held"}
	}
	exhausted := maps.Clone(a.exhausted)
	a.mu.Unlock()
	for _, u := range a.alloc.Usage() {
		ps := api.PoolStatus{Pool: u.Pool, Family: u.Family.String(), Capacity: u.Capacity, Used: u.Used, Reserved: u.Reserved, Free: u.Capacity - u.Used}
		ps.Blocks = append(ps.Blocks, u.Blocks...)
		ps.Exhausted = ps.Free == 0 && exhausted[u.Pool+"/"+u.Family.String()]
		st.Pools = append(st.Pools, ps)
	}
	return st
}

func (a *Agent) handleConfig(w http.ResponseWriter, r *http.Request) {
	var pools []string
	for _, p := range a.cfg.Pools {
		pools = append(pools, p.Name)
	}
	a.writeJSON(w, r, http.StatusOK, api.Config{
		Node: a.cfg.Node, MTU: a.podMTU, DefaultPool: a.cfg.defaultPool(), Pools: pools,
		Datapath: a.dp.Name(), GatewayV4: api.GatewayV4, GatewayV6: api.GatewayV6,
		ReservationTTL: a.cfg.ReservationTTL.String(),
	})
}

func (a *Agent) handleAllocate(w http.ResponseWriter, r *http.Request) {
	var req api.AllocateRequest
	if e := decode(w, r, &req); e != nil {
		a.writeError(w, r, e)
		return
	}
	areq, e := a.toRequest(req)
	if e != nil {
		a.writeError(w, r, e)
		return
	}
	if err := a.readyErr(); err != nil {
		a.writeError(w, r, tryAgain(err))
		return
	}
	ctx, cancel := a.requestContext(r)
	defer cancel()
	res, err := a.batch.allocate(ctx, areq)
	a.noteExhaustion(areq, err)
	if err != nil {
		a.writeError(w, r, apiError(err))
		return
	}
	a.writeJSON(w, r, http.StatusOK, a.allocateResponse(res))
}

// toRequest validates an allocate request, naming the field at fault.
func (a *Agent) toRequest(req api.AllocateRequest) (allocator.Request, *api.Error) {
	if e := validOwner(req.Owner); e != nil {
		return allocator.Request{}, e
	}
	out := allocator.Request{Pool: req.Pool, Owner: toOwner(req.Owner), Reserve: !req.Permanent}
	if out.Pool == "" {
		out.Pool = a.cfg.defaultPool()
	}
	if !slices.ContainsFunc(a.cfg.Pools, func(p allocator.Pool) bool { return p.Name == out.Pool }) {
		return out, badField("pool", fmt.Sprintf("pool %q is not served by node %s", out.Pool, a.cfg.Node))
	}
	for i, f := range req.Families {
		fam, err := allocator.ParseFamily(f)
		if err != nil {
			return out, badField(fmt.Sprintf("families[%d]", i), err.Error())
		}
		out.Families = append(out.Families, fam)
	}
	out.IPs = req.IPs // decoding refused a malformed one
	return out, nil
}

func (a *Agent) allocateResponse(res allocator.Result) api.AllocateResponse {
	out := api.AllocateResponse{Pool: res.Pool, MTU: a.podMTU, State: string(allocator.StateAllocated)}
	for _, al := range res.Allocations {
		gw := api.GatewayV4
		if al.Addr.Is6() {
			gw = api.GatewayV6
		}
		out.IPs = append(out.IPs, api.IPConfig{
			Address: netip.PrefixFrom(al.Addr, al.Addr.BitLen()), Family: allocator.FamilyOf(al.Addr).String(),
			Gateway: gw, Block: al.Block,
		})
		if al.State == allocator.StateReserved {
			out.State = string(allocator.StateReserved)
		}
	}
	if !res.Expires.IsZero() && out.State == string(allocator.StateReserved) {
		exp := res.Expires.UTC()
		out.Expires = &exp
	}
	return out
}

// noteExhaustion remembers which pool families last failed to find a
// block, for STATUS; a success clears it.
func (a *Agent) noteExhaustion(req allocator.Request, err error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	var ee *allocator.ExhaustedError
	if errors.As(err, &ee) {
		a.exhausted[ee.Pool+"/"+ee.Family.String()] = true
		return
	}
	if err == nil {
		for k := range a.exhausted {
			if strings.HasPrefix(k, req.Pool+"/") {
				delete(a.exhausted, k)
			}
		}
	}
}

func (a *Agent) handleRelease(w http.ResponseWriter, r *http.Request) {
	var req api.ReleaseRequest
	if e := decode(w, r, &req); e != nil {
		a.writeError(w, r, e)
		return
	}
	if e := validOwner(req.Owner); e != nil {
		a.writeError(w, r, e)
		return
	}
	if !a.isRestored() {
		// Until the node knows its allocations, a release would free
		// nothing and tear down a running pod's datapath for nothing.
		a.writeError(w, r, tryAgain(a.readyErr()))
		return
	}
	ctx, cancel := a.requestContext(r)
	defer cancel()
	released, err := a.release(ctx, req.Owner)
	if err != nil {
		a.writeError(w, r, apiError(err))
		return
	}
	a.writeJSON(w, r, http.StatusOK, api.ReleaseResponse{Released: released})
}

func (a *Agent) handleEndpointCreate(w http.ResponseWriter, r *http.Request) {
	var req api.EndpointRequest
	if e := decode(w, r, &req); e != nil {
		a.writeError(w, r, e)
		return
	}
	if e := validOwner(req.Owner); e != nil {
		a.writeError(w, r, e)
		return
	}
	if req.HostIfName == "" || len(req.HostIfName) > 15 {
		a.writeError(w, r, badField("hostIfName", fmt.Sprintf("hostIfName %q is not a valid interface name", req.HostIfName)))
		return
	}
	if err := a.readyErr(); err != nil {
		a.writeError(w, r, tryAgain(err))
		return
	}
	ctx, cancel := a.requestContext(r)
	defer cancel()
	ep, e := a.createEndpoint(ctx, req)
	if e != nil {
		a.writeError(w, r, e)
		return
	}
	a.writeJSON(w, r, http.StatusCreated, ep)
}

func (a *Agent) handleEndpointList(w http.ResponseWriter, r *http.Request) {
	eps := a.eps.list()
	if r.URL.Query().Get("stats") != "" {
		counters, err := a.dp.Counters()
		if err != nil {
			a.writeError(w, r, &api.Error{Status: http.StatusInternalServerError, Code: api.CodeInternal, Message: "read datapath counters: " + err.Error()})
			return
		}
		for i := range eps {
			if c, ok := counters[eps[i].ID]; ok {
				eps[i].Counters = &c
			}
		}
	}
	a.writeJSON(w, r, http.StatusOK, api.EndpointList{Endpoints: eps})
}

func (a *Agent) handleEndpointDelete(w http.ResponseWriter, r *http.Request) {
	o := api.Owner{ContainerID: r.URL.Query().Get("containerID"), IfName: r.URL.Query().Get("ifName")}
	if e := validOwner(o); e != nil {
		a.writeError(w, r, e)
		return
	}
	ctx, cancel := a.requestContext(r)
	defer cancel()
	if err := a.deleteEndpoint(ctx, o); err != nil {
		a.writeError(w, r, apiError(err))
		return
	}
	a.writeJSON(w, r, http.StatusOK, map[string]string{"status": "deleted"})
}

func (a *Agent) handleGC(w http.ResponseWriter, r *http.Request) {
	var req api.GCRequest
	if e := decode(w, r, &req); e != nil {
		a.writeError(w, r, e)
		return
	}
	if req.Pool != "" && !slices.ContainsFunc(a.cfg.Pools, func(p allocator.Pool) bool { return p.Name == req.Pool }) {
		a.writeError(w, r, badField("pool", fmt.Sprintf("pool %q is not served by node %s", req.Pool, a.cfg.Node)))
		return
	}
	for i, at := range req.ValidAttachments {
		if at.ContainerID == "" || at.IfName == "" {
			a.writeError(w, r, badField(fmt.Sprintf("validAttachments[%d]", i), "an attachment needs containerID and ifname"))
			return
		}
	}
	if err := a.readyErr(); err != nil {
		a.writeError(w, r, tryAgain(err))
		return
	}
	ctx, cancel := a.requestContext(r)
	defer cancel()
	res, err := a.collect(ctx, req, time.Now())
	if err != nil {
		a.writeError(w, r, apiError(err))
		return
	}
	a.writeJSON(w, r, http.StatusOK, res)
}

func (a *Agent) handleAllocations(w http.ResponseWriter, r *http.Request) {
	o := api.Owner{ContainerID: r.URL.Query().Get("containerID"), IfName: r.URL.Query().Get("ifName")}
	if e := validOwner(o); e != nil {
		a.writeError(w, r, e)
		return
	}
	out := api.AllocationList{Allocations: []api.Allocation{}}
	for _, al := range a.alloc.Lookup(toOwner(o)) {
		out.Allocations = append(out.Allocations, api.Allocation{
			Pool: al.Pool, Address: netip.PrefixFrom(al.Addr, al.Addr.BitLen()), Block: al.Block, State: string(al.State),
		})
	}
	a.writeJSON(w, r, http.StatusOK, out)
}
