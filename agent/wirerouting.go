package agent

import (
	"context"
	"net/netip"

	"github.com/hashicorp/go-hclog"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/routing"
	"github.com/kvipam/kvipam/routing/bgp"
)

// The agent's side of routing between nodes (package routing): the
// programmer of the routing mode, the overlay's overhead for the pod MTU,
// and the BGP speaker. The agent builds the parts and runs them (Run);
// routing knows nothing of the agent.

// The parts routing follows, as routing names them.
var (
	_ routing.PeerSource = (*etcdstore.Store)(nil)
	_ routing.HomeSource = (*etcdstore.Store)(nil)
	_ routing.Lease      = (*leaseKeeper)(nil)
	_ routing.Holdings   = (*nodealloc.Allocator)(nil)
	_ routing.Speaker    = (*bgp.Speaker)(nil)
)

// newRouteProgrammer is the programmer of a routing mode; nil for none.
func newRouteProgrammer(cfg *Config, log hclog.Logger) routing.Programmer {
	switch cfg.Routing {
	case RoutingHostGW:
		return routing.NewHostGW(log)
	case RoutingVXLAN:
		return routing.NewVXLAN(routing.VXLANConfig{Node: cfg.Node, VNI: cfg.VXLAN.VNI, Port: cfg.VXLAN.Port,
			IPv6Underlay: cfg.VXLAN.Underlay == UnderlayIPv6, Addresses: routing.NodeAddresses(cfg.NodeAddresses, cfg.NetNS)}, log)
	}
	return nil
}

// overlayOverhead is what the overlay of cfg adds to a packet.
func overlayOverhead(cfg *Config) int {
	return routing.VXLANOverhead(cfg.VXLAN.Underlay == UnderlayIPv6)
}

// startBGP starts the BGP speaker of routing bgp; it peers once the
// announcer has the node's homes on a proven lease. Its graceful-restart
// time defaults to the longest the lease allows (bgp.MaxRestartTime).
// The agent never stops it: stopping would send each router a Cease, and
// routers withdraw a node's routes on a Cease; the sessions end with the
// process instead, a TCP close that a graceful-restart helper answers by
// keeping them (docs/routing.md).
func (a *Agent) startBGP(ctx context.Context, bootID string) error {
	var rid netip.Addr
	for _, s := range a.recorder.addrs {
		if ad, err := netip.ParseAddr(s); err == nil && ad.Is4() {
			rid = ad
			break
		}
	}
	cfg := a.cfg.BGP
	if cfg.RestartTime.Duration == 0 {
		cfg.RestartTime.Duration = bgp.MaxRestartTime(a.cfg.LeaseTTL.Duration)
	}
	sp, err := bgp.Start(ctx, cfg, bgp.Options{Node: a.cfg.Node, RouterID: rid, Restarting: bgp.Restarting(a.cfg.StateDir, bootID),
		Logger: a.log.Named("bgp")})
	if err != nil {
		return err
	}
	a.speaker = sp
	a.m.reg.MustRegister(sp.Collector())
	return nil
}
