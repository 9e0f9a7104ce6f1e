package agent

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/netip"
	"slices"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/allocator"
)

// createEndpoint finishes an ADD: the owner's reservation becomes
// permanent (a fenced etcd write), then the datapath is programmed, then
// the record is saved, all before the answer. A failure leaves the
// allocation for the plugin's rollback (release) to undo.
func (a *Agent) createEndpoint(ctx context.Context, req api.EndpointRequest) (api.Endpoint, *api.Error) {
	a.epMu.Lock()
	defer a.epMu.Unlock()
	owner := toOwner(req.Owner)
	held := a.alloc.Lookup(owner)
	if len(held) == 0 {
		return api.Endpoint{}, &api.Error{Status: http.StatusNotFound, Code: api.CodeNotFound,
			Message: fmt.Sprintf("no reservation for %s: allocate first, or it expired", owner.Key())}
	}
	var ips []netip.Addr
	for _, al := range held {
		ips = append(ips, al.Addr)
	}
	for i, p := range req.IPs {
		if !slices.Contains(ips, p.Addr()) {
			return api.Endpoint{}, badField(fmt.Sprintf("ips[%d]", i), fmt.Sprintf("ips[%d] %q is not held by %s (holds %v)", i, p, owner.Key(), ips))
		}
	}
	if _, err := a.alloc.Confirm(ctx, owner); err != nil {
		return api.Endpoint{}, apiError(err)
	}
	ep := api.Endpoint{
		Owner: req.Owner, HostIfName: req.HostIfName, ContainerIfName: req.ContainerIfName,
		ContainerMAC: req.ContainerMAC, Netns: req.Netns, IPs: ips, Datapath: a.dp.Name(), Created: time.Now().UTC(),
	}
	a.eps.assignID(&ep)
	if err := a.dp.Setup(ctx, &ep); err != nil {
		var nf netlink.LinkNotFoundError
		if errors.As(err, &nf) {
			return api.Endpoint{}, badField("hostIfName", err.Error())
		}
		return api.Endpoint{}, &api.Error{Status: http.StatusInternalServerError, Code: api.CodeInternal, Message: "program datapath: " + err.Error()}
	}
	if err := a.eps.put(ep); err != nil {
		_ = a.dp.Teardown(ctx, ep)
		return api.Endpoint{}, &api.Error{Status: http.StatusInternalServerError, Code: api.CodeInternal, Message: err.Error()}
	}
	a.log.Debug("endpoint created", "owner", ep.Owner.Key(), "id", ep.ID, "ips", ep.IPs, "host_if", ep.HostIfName)
	return ep, nil
}

// deleteEndpoint removes an endpoint's datapath state and record, keeping
// its IPs. Deleting what does not exist succeeds.
func (a *Agent) deleteEndpoint(ctx context.Context, o api.Owner) error {
	a.epMu.Lock()
	defer a.epMu.Unlock()
	return a.deleteEndpointLocked(ctx, o)
}

func (a *Agent) deleteEndpointLocked(ctx context.Context, o api.Owner) error {
	ep, ok := a.eps.get(o)
	if !ok {
		return nil
	}
	if err := a.dp.Teardown(ctx, ep); err != nil {
		return fmt.Errorf("tear down endpoint %s: %w", o.Key(), err)
	}
	return a.eps.remove(o)
}

// release tears the owner's endpoint down and frees its IPs; idempotent.
func (a *Agent) release(ctx context.Context, o api.Owner) ([]string, error) {
	a.epMu.Lock()
	defer a.epMu.Unlock()
	return a.releaseLocked(ctx, o)
}

func (a *Agent) releaseLocked(ctx context.Context, o api.Owner) ([]string, error) {
	if err := a.deleteEndpointLocked(ctx, o); err != nil {
		return nil, err
	}
	rel, err := a.alloc.Release(ctx, toOwner(o))
	out := make([]string, 0, len(rel))
	for _, al := range rel {
		out = append(out, al.Addr.String())
	}
	if len(rel) > 0 {
		a.mu.Lock()
		clear(a.exhausted)
		a.mu.Unlock()
	}
	return out, err
}

// releaseEndpoint releases ep's owner as release does, but only if ep is
// still the owner's endpoint (same ID and creation time): the reconciler
// judged that one, not a later ADD of the same attachment. same reports
// whether it was.
func (a *Agent) releaseEndpoint(ctx context.Context, ep api.Endpoint) (ips []string, same bool, err error) {
	a.epMu.Lock()
	defer a.epMu.Unlock()
	cur, ok := a.eps.get(ep.Owner)
	if !ok || cur.ID != ep.ID || !cur.Created.Equal(ep.Created) {
		return nil, false, nil
	}
	ips, err = a.releaseLocked(ctx, ep.Owner)
	return ips, true, err
}

// releaseIPs frees allocations GC decided on from a snapshot. Each is
// released only if etcd still holds it at the snapshot's revision, so an
// address that was deleted and handed to a new owner since is left alone.
// The owner's endpoint is torn down once it holds nothing more.
func (a *Agent) releaseIPs(ctx context.Context, als []allocator.Allocation) ([]string, error) {
	a.epMu.Lock()
	defer a.epMu.Unlock()
	var out []string
	var errs []error
	for _, al := range als {
		gone, err := a.alloc.ReleaseAllocation(ctx, al)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if !gone {
			a.log.Info("gc: allocation changed since GC decided; left alone", "ip", al.Addr, "owner", al.Owner.Key())
			continue
		}
		out = append(out, al.Addr.String())
		o := api.Owner{ContainerID: al.ContainerID, IfName: al.IfName}
		if len(a.alloc.Lookup(al.Owner)) == 0 {
			if err := a.deleteEndpointLocked(ctx, o); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return out, errors.Join(errs...)
}

// detectMTU is the pod MTU: configured, else the MTU of the link of the
// default route in the datapath's namespace, else 1500. It runs once at
// start, not on every ADD.
func (a *Agent) detectMTU() int {
	if a.cfg.MTU != 0 {
		return a.cfg.MTU
	}
	h, err := openNetlink(a.cfg.NetNS)
	if err != nil {
		return 1500
	}
	defer h.Close()
	routes, err := h.RouteList(nil, netlink.FAMILY_V4)
	if err != nil {
		return 1500
	}
	for _, r := range routes {
		if r.Dst == nil || r.Dst.IP.IsUnspecified() {
			if l, err := h.LinkByIndex(r.LinkIndex); err == nil && l.Attrs().MTU > 0 {
				return l.Attrs().MTU
			}
		}
	}
	return 1500
}
