package cni

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"

	"github.com/kvipam/kvipam/agent/api"
)

// Check verifies an attachment against its prevResult: the veth ends, the
// pod's addresses and the routes kvipam made, the host routes, and that
// the agent still has the endpoint with the same IPs (so the allocation is
// still this attachment's). Routes a later plugin added are not its
// business.
func (p *Plugin) Check(args *skel.CmdArgs) error {
	v, err := p.begin(pluginName, ParseConfig, args)
	if err != nil {
		return err
	}
	defer v.done()
	if v.c.PrevResult == nil {
		return invalidConf("CHECK needs the prevResult of the ADD")
	}
	spec, podMAC, routes, err := expected(v.c.PrevResult, args)
	if err != nil {
		return err
	}
	local := CheckPod(spec, podMAC, routes)

	// The agent's calls get the whole agent timeout after the local
	// checks, however long those took.
	ctx, cancel := context.WithTimeout(context.Background(), v.c.AgentTimeout)
	defer cancel()
	remote := checkEndpoint(ctx, v.ag, args, spec.Addrs)
	if local != nil {
		return withCode(Code(local), errors.Join(local, remote))
	}
	return remote
}

// expected reads from prevResult what kvipam made for the attachment.
func expected(r *current.Result, args *skel.CmdArgs) (PodSpec, string, []*types.Route, error) {
	s := PodSpec{Netns: args.Netns, IfName: args.IfName, HostIfName: HostVethName(args.ContainerID, args.IfName)}
	podIdx, hostIdx := -1, -1
	for i, in := range r.Interfaces {
		switch {
		case in.Name == args.IfName && in.Sandbox != "":
			podIdx = i
		case in.Name == s.HostIfName && in.Sandbox == "":
			hostIdx = i
		}
	}
	if podIdx < 0 || hostIdx < 0 {
		return s, "", nil, withCode(types.ErrInvalidNetworkConfig,
			fmt.Errorf("check: prevResult lacks interface %s in a sandbox or host veth %s: not a kvipam attachment", args.IfName, s.HostIfName))
	}
	for _, ipc := range r.IPs {
		if ipc.Interface == nil || *ipc.Interface != podIdx {
			continue
		}
		p := prefixOf(&ipc.Address)
		if !p.IsValid() {
			return s, "", nil, withCode(types.ErrDecodingFailure, fmt.Errorf("check: prevResult address %s is not valid", ipc.Address.String()))
		}
		s.Addrs = append(s.Addrs, p)
		if gw, ok := netip.AddrFromSlice(ipc.Gateway); ok {
			if gw = gw.Unmap(); gw.Is4() {
				s.GatewayV4 = gw
			} else {
				s.GatewayV6 = gw
			}
		}
	}
	if len(s.Addrs) == 0 {
		return s, "", nil, withCode(types.ErrInvalidNetworkConfig, fmt.Errorf("check: prevResult has no address on %s", args.IfName))
	}
	gw4, gw6 := gateways(nil, s.GatewayV4, s.GatewayV6)
	s.GatewayV4, s.GatewayV6 = gw4, gw6
	// Only the routes kvipam makes and the result still lists.
	var routes []*types.Route
	for _, want := range podRoutes(s) {
		if slices.ContainsFunc(r.Routes, func(rr *types.Route) bool { return rr.Dst.String() == want.Dst.String() && rr.GW.Equal(want.GW) }) {
			routes = append(routes, want)
		}
	}
	return s, r.Interfaces[podIdx].Mac, routes, nil
}

// checkEndpoint asks the agent whether the attachment's endpoint exists
// and holds exactly the addresses of the result.
func checkEndpoint(ctx context.Context, ag Agent, args *skel.CmdArgs, addrs []netip.Prefix) error {
	eps, err := ag.Endpoints(ctx)
	if err != nil {
		return fmt.Errorf("check: list agent endpoints: %w", err)
	}
	o := api.Owner{ContainerID: args.ContainerID, IfName: args.IfName}
	i := slices.IndexFunc(eps, func(ep api.Endpoint) bool { return ep.Owner.Key() == o.Key() })
	if i < 0 {
		return fmt.Errorf("check: the agent has no endpoint for %s: its IPs were released", o.Key())
	}
	var want, got []string
	for _, a := range addrs {
		want = append(want, a.Addr().String())
	}
	for _, a := range eps[i].IPs {
		got = append(got, a.String())
	}
	slices.Sort(want)
	slices.Sort(got)
	if !slices.Equal(want, got) {
		return fmt.Errorf("check: the agent's endpoint for %s holds %s, the result says %s",
			o.Key(), strings.Join(got, ","), strings.Join(want, ","))
	}
	return nil
}
