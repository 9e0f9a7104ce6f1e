package cni

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	current "github.com/containernetworking/cni/pkg/types/100"

	"github.com/kvipam/kvipam/agent/api"
)

// IO is a plugin's I/O: where results and logs go and how the node agent
// is dialled. Tests set it to run plugins in-process.
type IO struct {
	// Stdout receives the result; Stderr the logs when logFile is unset.
	Stdout io.Writer
	Stderr io.Writer
	// NewAgent dials the node agent; NewAgentClient by default.
	NewAgent func(socket string, timeout time.Duration) Agent
}

// ProcessIO is the I/O of a plugin run by a container runtime.
func ProcessIO() IO {
	return IO{Stdout: os.Stdout, Stderr: os.Stderr, NewAgent: NewAgentClient}
}

func (o IO) agent(c *Config) Agent {
	if o.NewAgent == nil {
		return NewAgentClient(c.Socket, c.AgentTimeout)
	}
	return o.NewAgent(c.Socket, c.AgentTimeout)
}

// commands are the CNI verbs a plugin implements.
type commands interface {
	Add(*skel.CmdArgs) error
	Del(*skel.CmdArgs) error
	Check(*skel.CmdArgs) error
	Status(*skel.CmdArgs) error
	GC(*skel.CmdArgs) error
}

// funcsOf wires a plugin's verbs for skel.PluginMainFuncs. Every error
// they return is a *types.Error with the code from Code.
func funcsOf(p commands) skel.CNIFuncs {
	return skel.CNIFuncs{
		Add:    func(a *skel.CmdArgs) error { return result(p.Add(a)) },
		Del:    func(a *skel.CmdArgs) error { return result(p.Del(a)) },
		Check:  func(a *skel.CmdArgs) error { return result(p.Check(a)) },
		Status: func(a *skel.CmdArgs) error { return result(p.Status(a)) },
		GC:     func(a *skel.CmdArgs) error { return result(p.GC(a)) },
	}
}

// Plugin is the kvipam CNI plugin. Its IO is its I/O, so tests can run it
// in-process; a Plugin is safe for concurrent use when that is.
type Plugin struct{ IO }

// NewPlugin returns a Plugin on the process's stdout and stderr.
func NewPlugin() *Plugin { return &Plugin{ProcessIO()} }

// Funcs are the plugin's commands for skel.PluginMainFuncs.
func (p *Plugin) Funcs() skel.CNIFuncs { return funcsOf(p) }

// Add sets a pod up with two calls to the agent: reserve IPs (waiting
// for the agent if it is restarting; the answer carries the gateways and
// the MTU) while the veth pair is created, configure the veth with the
// addresses, have the agent create the endpoint (which confirms the
// reservation and programs the datapath before it answers), then print
// the result. Any failure removes the veth and, after the reservation,
// releases the IPs.
func (p *Plugin) Add(args *skel.CmdArgs) error {
	v, o, err := p.beginAdd(pluginName, ParseConfig, args)
	if err != nil {
		return err
	}
	defer v.done()
	c, log, ag := v.c, v.log, v.ag
	if c.PrevResult != nil {
		return invalidConf("kvipam creates the pod's interface, so it must be the first plugin of the chain; it was given a prevResult")
	}
	if err := checkNetns(args.Netns); err != nil {
		return err
	}
	start := time.Now()

	ctx := context.Background() // each call is bounded by the client's timeout
	// The veth is made while the agent allocates: its names come from
	// the owner, its addresses later. The allocation runs in another
	// goroutine because the veth must be made on this thread, the one
	// in the host netns (a caller may have locked it there).
	allocated := make(chan error, 1)
	var alloc *api.AllocateResponse
	go func() {
		var err error
		alloc, err = allocate(ctx, ag, c, o, false)
		allocated <- err
	}()
	hostIf := HostVethName(o.ContainerID, o.IfName)
	veth, verr := CreatePodVeth(PodSpec{Netns: args.Netns, IfName: args.IfName, HostIfName: hostIf, MTU: podMTU(c.MTU), AcceptLocal: len(c.PortMappings) > 0})
	if err := <-allocated; err != nil {
		if verr == nil {
			err = errors.Join(err, veth.Remove())
			veth.Close()
		}
		return err
	}
	log.Debug("reserved", "owner", o.Key(), "ips", alloc.IPs, "expires", alloc.Expires, "allocate", time.Since(start))
	if verr != nil {
		return rollback(ag, c, o, nil, log, verr)
	}
	defer veth.Close()

	res, err := p.setUp(ctx, ag, c, o, args, veth, alloc, log)
	if err != nil {
		return rollback(ag, c, o, veth.Remove, log, err)
	}
	if err := PrintResult(p.Stdout, res, c.CNIVersion); err != nil {
		return rollback(ag, c, o, veth.Remove, log, err)
	}
	log.Info("added", "owner", o.Key(), "pod", o.Namespace+"/"+o.Pod, "ips", alloc.IPs, "took", time.Since(start))
	return nil
}

// setUp is ADD after the reservation, on the veth made meanwhile.
func (p *Plugin) setUp(ctx context.Context, ag Agent, c *Config, o api.Owner, args *skel.CmdArgs, veth *PodVeth, alloc *api.AllocateResponse, log logger) (*current.Result, error) {
	als, err := parseAllocation(alloc)
	if err != nil {
		return nil, err
	}
	gw4, gw6 := gateways(als, netip.Addr{}, netip.Addr{})
	spec := PodSpec{
		Netns: args.Netns, IfName: args.IfName, HostIfName: HostVethName(o.ContainerID, o.IfName),
		MTU: podMTU(c.MTU, alloc.MTU), GatewayV4: gw4, GatewayV6: gw6,
		// A live migration's target forwards nothing until the cut-over:
		// the agent routes its addresses to it then.
		NoHostRoutes: alloc.Alternate,
	}
	for _, al := range als {
		spec.Addrs = append(spec.Addrs, al.Addr)
	}
	start := time.Now()
	links, err := veth.Configure(spec)
	if err != nil {
		return nil, err
	}
	setup := time.Since(start)
	req := api.EndpointRequest{
		Owner: o, HostIfName: links.HostIfName, ContainerIfName: links.PodIfName,
		ContainerMAC: links.PodMAC.String(), Netns: args.Netns, IPs: spec.Addrs,
		EgressLimited: c.EgressLimited, PortMappings: c.PortMappings,
	}
	if _, err := ag.CreateEndpoint(ctx, req); err != nil {
		return nil, fmt.Errorf("create endpoint for %s: %w", o.Key(), err)
	}
	log.Debug("set up", "owner", o.Key(), "configure", setup, "endpoint", time.Since(start)-setup)
	return podResult(spec, links, c.DNS), nil
}

// Del releases the owner's IPs through the agent, which retires the host
// veth first (no routes, no traffic: the datapath drops it) and deletes it
// in the background, the pod end with it; or, when the agent is down, it
// deletes the veth and queues the release. It needs no netns and
// succeeds when there is nothing to delete.
func (p *Plugin) Del(args *skel.CmdArgs) error {
	v, err := p.begin(pluginName, ParseDelConfig, args)
	if err != nil {
		return err
	}
	defer v.done()
	o := delOwner(args, v.c.Name, v.log)
	hostIf := HostVethName(o.ContainerID, o.IfName)
	queued, err := releaseOrQueue(v.ag, v.c, o, hostIf, v.log)
	if err != nil {
		return err
	}
	v.log.Info("deleted", "owner", o.Key(), "host_if", hostIf, "release_queued", queued)
	return nil
}

func podMTU(choices ...int) int {
	for _, m := range choices {
		if m > 0 {
			return m
		}
	}
	return 1500
}

// Status reports whether an ADD could succeed now (CNI 1.1 STATUS).
func (p *Plugin) Status(args *skel.CmdArgs) error {
	v, err := p.begin(pluginName, ParseConfig, args)
	if err != nil {
		return err
	}
	defer v.done()
	return checkStatus(v.ctx, v.ag, v.c)
}

// GC releases this network's pool's allocations on the node whose
// attachments are not in cni.dev/valid-attachments, and removes the host
// veths of the endpoints it released.
func (p *Plugin) GC(args *skel.CmdArgs) error {
	v, err := p.begin(pluginName, ParseConfig, args)
	if err != nil {
		return err
	}
	defer v.done()
	if v.c.ValidAttachments == nil {
		v.log.Info("gc without a valid-attachments list: nothing to do")
		return nil
	}
	eps, err := v.ag.Endpoints(v.ctx)
	if err != nil {
		return fmt.Errorf("gc: list agent endpoints: %w", err)
	}
	res, err := gcPool(v.ctx, v.ag, v.c)
	if err != nil {
		return err
	}
	var errs []error
	for _, ep := range eps {
		if !strings.HasPrefix(ep.HostIfName, HostVethPrefix) || !slices.ContainsFunc(ep.IPs, func(ip netip.Addr) bool { return slices.Contains(res.Released, ip.String()) }) {
			continue
		}
		if _, err := DeleteHostVeth(ep.HostIfName); err != nil {
			errs = append(errs, fmt.Errorf("gc: %w", err))
		}
	}
	v.log.Info("gc", "released", res.Released, "deferred", res.Deferred, "errors", len(errs))
	return errors.Join(errs...)
}
