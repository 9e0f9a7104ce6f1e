package cni

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/containernetworking/cni/pkg/skel"

	"github.com/kvipam/kvipam/agent/api"
)

// IPAM is the kvipam-ipam CNI IPAM plugin: kvipam's allocations for a
// main plugin (bridge, macvlan, ipvlan) that makes the interface itself.
// Its allocations are permanent at once: no endpoint follows, so there is
// no reservation to confirm. Like Plugin, its IO is its I/O.
type IPAM struct{ IO }

// NewIPAM returns an IPAM on the process's stdout and stderr.
func NewIPAM() *IPAM { return &IPAM{ProcessIO()} }

// Funcs are the plugin's commands for skel.PluginMainFuncs.
func (p *IPAM) Funcs() skel.CNIFuncs { return funcsOf(p) }

// Add allocates the attachment's IPs and prints them with their gateways
// and routes. An address carries its block's prefix length unless
// ipam.addressPrefix is "host"; ipam.gatewayV4/gatewayV6 and ipam.routes
// adapt the result to the main plugin's network (deploy/cni/README.md).
func (p *IPAM) Add(args *skel.CmdArgs) error {
	v, o, err := p.beginAdd(ipamName, ParseIPAMConfig, args)
	if err != nil {
		return err
	}
	defer v.done()
	c, log, ag := v.c, v.log, v.ag
	ctx := context.Background() // each call is bounded by the client's timeout
	alloc, err := allocate(ctx, ag, c, o, true)
	if err != nil {
		return err
	}
	als, err := parseAllocation(alloc)
	if err != nil {
		return rollback(ag, c, o, nil, log, err)
	}
	gw4, gw6 := gateways(als, netip.Addr{}, netip.Addr{})
	res := ipamResult(als, c, gw4, gw6)
	if err := PrintResult(p.Stdout, res, c.CNIVersion); err != nil {
		return rollback(ag, c, o, nil, log, err)
	}
	log.Info("allocated", "owner", o.Key(), "ips", alloc.IPs)
	return nil
}

// Del releases the attachment's IPs, or queues the release when the agent
// is down; it succeeds when there is nothing to release.
func (p *IPAM) Del(args *skel.CmdArgs) error {
	v, err := p.begin(ipamName, ParseIPAMDelConfig, args)
	if err != nil {
		return err
	}
	defer v.done()
	_, err = releaseOrQueue(v.ag, v.c, delOwner(args, v.c.Name, v.log), "", v.log)
	return err
}

// Check verifies that the agent still holds every address of the
// prevResult for this attachment (container ID and interface).
func (p *IPAM) Check(args *skel.CmdArgs) error {
	v, err := p.begin(ipamName, ParseIPAMConfig, args)
	if err != nil {
		return err
	}
	defer v.done()
	if v.c.PrevResult == nil {
		return invalidConf("CHECK needs the prevResult of the ADD")
	}
	o := api.Owner{ContainerID: args.ContainerID, IfName: args.IfName}
	held, err := v.ag.Allocations(v.ctx, o)
	if err != nil {
		return fmt.Errorf("check: agent allocations: %w", err)
	}
	var missing []string
	for _, ipc := range v.c.PrevResult.IPs {
		a := prefixOf(&ipc.Address).Addr()
		if !slices.ContainsFunc(held, func(h api.Allocation) bool { return h.Address.Addr() == a }) {
			missing = append(missing, a.String())
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("check: %s no longer held by %s", strings.Join(missing, ", "), o.Key())
	}
	return nil
}

// Status reports whether an ADD could succeed now (CNI 1.1 STATUS).
func (p *IPAM) Status(args *skel.CmdArgs) error {
	v, err := p.begin(ipamName, ParseIPAMConfig, args)
	if err != nil {
		return err
	}
	defer v.done()
	return checkStatus(v.ctx, v.ag, v.c)
}

// GC releases this network's pool's allocations on the node whose
// attachments are not in cni.dev/valid-attachments.
func (p *IPAM) GC(args *skel.CmdArgs) error {
	v, err := p.begin(ipamName, ParseIPAMConfig, args)
	if err != nil {
		return err
	}
	defer v.done()
	res, err := gcPool(v.ctx, v.ag, v.c)
	if err != nil {
		return err
	}
	v.log.Info("gc", "released", res.Released, "deferred", res.Deferred)
	return nil
}
