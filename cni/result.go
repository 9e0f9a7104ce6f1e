package cni

import (
	"fmt"
	"io"
	"net"
	"net/netip"
	"slices"

	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"

	"github.com/kvipam/kvipam/agent/api"
)

// Allocated is one address the agent handed out, parsed.
type Allocated struct {
	// Addr is the pod address with its host prefix: 10.0.0.5/32.
	Addr netip.Prefix
	// Gateway is the agent's link-local next hop for the family; the
	// zero Addr when the agent named none.
	Gateway netip.Addr
	// Block is the node block the address is from; the zero Prefix when
	// the agent named none.
	Block netip.Prefix
}

// parseAllocation checks the agent's answer; an answer the plugin cannot
// use is an internal error, not the user's.
func parseAllocation(r *api.AllocateResponse) ([]Allocated, error) {
	if r == nil || len(r.IPs) == 0 {
		return nil, fmt.Errorf("agent allocated no address")
	}
	out := make([]Allocated, 0, len(r.IPs))
	for _, ipc := range r.IPs {
		a := ipc.Address.Addr()
		if !a.IsValid() {
			return nil, fmt.Errorf("agent answered an invalid address (%s)", ipc.Address)
		}
		al := Allocated{Addr: netip.PrefixFrom(a, a.BitLen())}
		if ipc.Gateway.IsValid() {
			if ipc.Gateway.Is4() != a.Is4() {
				return nil, fmt.Errorf("agent answered gateway %s for %s", ipc.Gateway, ipc.Address)
			}
			al.Gateway = ipc.Gateway
		}
		if ipc.Block.Contains(a) {
			al.Block = ipc.Block
		}
		out = append(out, al)
	}
	return out, nil
}

// gateways picks the pod's gateways: the configuration's, else the
// allocation's, else api.GatewayV4/V6.
func gateways(als []Allocated, conf4, conf6 netip.Addr) (gw4, gw6 netip.Addr) {
	gw4, gw6 = conf4, conf6
	for _, al := range als {
		if al.Addr.Addr().Is4() && !gw4.IsValid() {
			gw4 = al.Gateway
		}
		if al.Addr.Addr().Is6() && !gw6.IsValid() {
			gw6 = al.Gateway
		}
	}
	if !gw4.IsValid() {
		gw4 = api.GatewayV4
	}
	if !gw6.IsValid() {
		gw6 = api.GatewayV6
	}
	return gw4, gw6
}

// podResult is the kvipam plugin's result: the host veth (interface 0),
// the pod interface (1) holding every address, and the routes Configure
// made in the pod.
func podResult(s PodSpec, l *PodLinks, dns types.DNS) *current.Result {
	r := &current.Result{
		CNIVersion: current.ImplementedSpecVersion,
		Interfaces: []*current.Interface{
			{Name: l.HostIfName, Mac: l.HostMAC.String()},
			{Name: l.PodIfName, Mac: l.PodMAC.String(), Sandbox: s.Netns},
		},
		Routes: podRoutes(s),
		DNS:    dns,
	}
	for _, a := range s.Addrs {
		gw := s.GatewayV4
		if a.Addr().Is6() {
			gw = s.GatewayV6
		}
		r.IPs = append(r.IPs, &current.IPConfig{Interface: current.Int(1), Address: *hostPrefix(a.Addr(), a.Bits()), Gateway: net.IP(gw.AsSlice())})
	}
	return r
}

// ipamResult is kvipam-ipam's result: addresses with no interface (the
// main plugin assigns them), and routes.
//
// By default (ipam.addressPrefix "block") an address carries its block's
// prefix length (10.2.3.5/26), as main plugins expect a subnet: pods of a
// block reach each other on the link, and bridge's CHECK looks for the
// subnet route. With "host" it is a /32 or /128; ipam.prefixLengthV4/V6
// set it outright.
//
// A gateway the configuration names (conf4, conf6) is given with each
// address of its family, for the main plugin to use (bridge's isGateway
// puts it on the bridge), and routes go through it: the user vouches that
// it is on-link. Otherwise the pod routes through the link-local
// gateways (gw4, gw6) and the addresses have no gateway: main plugins
// configure the pod with ipam.ConfigureIface, which would give the
// gateway's own link route "169.254.1.1/32" the address's gateway,
// which cannot be added. ipam.routes replace the default routes.
func ipamResult(als []Allocated, c *Config, gw4, gw6 netip.Addr) *current.Result {
	r := &current.Result{CNIVersion: current.ImplementedSpecVersion, DNS: c.DNS}
	conf4, conf6 := c.GatewayV4, c.GatewayV6
	var gws []netip.Addr
	for _, al := range als {
		conf, gw, bits := conf4, gw4, c.PrefixLengthV4
		if al.Addr.Addr().Is6() {
			conf, gw, bits = conf6, gw6, c.PrefixLengthV6
		}
		switch {
		case bits > 0:
		case c.AddressPrefix != AddressPrefixHost && al.Block.IsValid():
			bits = al.Block.Bits()
		default:
			bits = al.Addr.Bits()
		}
		ipc := &current.IPConfig{Address: *hostPrefix(al.Addr.Addr(), bits)}
		if conf.IsValid() {
			ipc.Gateway = net.IP(conf.AsSlice())
			gw = conf
		}
		r.IPs = append(r.IPs, ipc)
		if !slices.Contains(gws, gw) {
			gws = append(gws, gw)
		}
	}
	if c.Routes != nil {
		r.Routes = c.Routes
		return r
	}
	for _, gw := range gws {
		for _, rt := range gatewayRoutes([]netip.Addr{gw}) {
			if rt.GW == nil && gw == conf4 {
				continue // a configured gateway is on-link: no link route
			}
			r.Routes = append(r.Routes, rt)
		}
	}
	return r
}

// PrintResult writes r to w in cniVersion, the configuration's version,
// which is the only one an older runtime can read.
func PrintResult(w io.Writer, r *current.Result, cniVersion string) error {
	out, err := r.GetAsVersion(cniVersion)
	if err != nil {
		return fmt.Errorf("convert result to CNI %s: %w", cniVersion, err)
	}
	if err := out.PrintTo(w); err != nil {
		return withCode(types.ErrIOFailure, fmt.Errorf("print result: %w", err))
	}
	return nil
}
