package agent

import (
	"context"
	"errors"
	"fmt"

	"github.com/hashicorp/go-hclog"
	"github.com/vishvananda/netlink"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/internal/foundation/netlinkns"
)

// Datapath programs the kernel for endpoints. Setup runs inside the
// endpoint create request, so when ADD returns the pod's datapath is in
// force. Implementations are safe for concurrent use.
type Datapath interface {
	// Name is "routes" or "bpf".
	Name() string
	// Setup enforces ep's datapath and fills ep.HostIfIndex. It is
	// idempotent: a retried ADD sets the same endpoint up again.
	Setup(ctx context.Context, ep *api.Endpoint) error
	// Teardown removes what Setup made; the host interface may be gone.
	Teardown(ctx context.Context, ep api.Endpoint) error
	// Retire stops ep's traffic for good while its host interface waits
	// to be deleted: its addresses may be handed out at once after.
	Retire(ctx context.Context, ep api.Endpoint) error
	// Forget removes what a retired ep left once its interface is gone.
	Forget(ep api.Endpoint) error
	// Adopt takes over the state a previous agent left for eps, without
	// a gap in enforcement.
	Adopt(ctx context.Context, eps []api.Endpoint) error
	// HostLinkExists reports whether ep's host interface still exists; a
	// pod netns deleted without DEL takes the veth with it.
	HostLinkExists(ep api.Endpoint) (bool, error)
	// Counters returns per-endpoint counters by endpoint ID; nil when the
	// datapath keeps none.
	Counters() (map[uint32]api.Counters, error)
	// Close releases handles; pinned state stays in the kernel.
	Close() error
}

// routesDatapath is the datapath without eBPF: the plugin routes each pod
// address to its host veth, and the agent checks the veth is there.
type routesDatapath struct {
	nl *netlink.Handle
}

var _ Datapath = (*routesDatapath)(nil)

func newRoutesDatapath(netnsPath string) (*routesDatapath, error) {
	h, err := netlinkns.Open(netnsPath)
	if err != nil {
		return nil, err
	}
	return &routesDatapath{nl: h}, nil
}

func (d *routesDatapath) Name() string { return DatapathRoutes }

func (d *routesDatapath) Setup(_ context.Context, ep *api.Endpoint) error {
	l, err := d.nl.LinkByName(ep.HostIfName)
	if err != nil {
		return fmt.Errorf("find host interface %q: %w", ep.HostIfName, err)
	}
	ep.HostIfIndex = l.Attrs().Index
	return nil
}

func (d *routesDatapath) Teardown(context.Context, api.Endpoint) error { return nil }

// Retire has nothing to do: the retired veth has no routes and is down.
func (d *routesDatapath) Retire(context.Context, api.Endpoint) error { return nil }

func (d *routesDatapath) Forget(api.Endpoint) error { return nil }

func (d *routesDatapath) Adopt(context.Context, []api.Endpoint) error { return nil }

func (d *routesDatapath) HostLinkExists(ep api.Endpoint) (bool, error) {
	return hostLinkExists(d.nl, ep)
}

func hostLinkExists(h *netlink.Handle, ep api.Endpoint) (bool, error) {
	l, err := h.LinkByName(ep.HostIfName)
	var nf netlink.LinkNotFoundError
	if errors.As(err, &nf) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("find host interface %q: %w", ep.HostIfName, err)
	}
	// A new veth with a reused name is not the endpoint's.
	return ep.HostIfIndex == 0 || l.Attrs().Index == ep.HostIfIndex, nil
}

func (d *routesDatapath) Counters() (map[uint32]api.Counters, error) { return nil, nil }

func (d *routesDatapath) Close() error {
	d.nl.Close()
	return nil
}

// openDatapath opens the configured datapath; auto prefers eBPF and falls
// back to routes when the kernel cannot run it.
func openDatapath(cfg Config, log hclog.Logger) (Datapath, error) {
	mode := cfg.Datapath
	if mode == DatapathBPF || mode == DatapathAuto {
		dp, err := newBPFDatapath(cfg.BPFPinDir, cfg.BPFAttach, cfg.NetNS, log)
		if err == nil {
			dp.serveHostPorts(cfg, log)
			return dp, nil
		}
		if mode == DatapathBPF {
			return nil, fmt.Errorf("datapath bpf: %w", err)
		}
		log.Warn("eBPF datapath unavailable, using routes mode", "reason", err)
	}
	return newRoutesDatapath(cfg.NetNS)
}

// detectMTU is the pod MTU: configured, else the MTU of the link of the
// default route in the datapath's namespace, else 1500. It runs once at
// start, not on every ADD.
func detectMTU(configured int, netnsPath string) int {
	if configured != 0 {
		return configured
	}
	h, err := netlinkns.Open(netnsPath)
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
