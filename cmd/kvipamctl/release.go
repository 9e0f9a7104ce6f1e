package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"

	"github.com/spf13/cobra"

	"github.com/kvipam/kvipam/allocator/inspect"
)

// releaseRequest is what release was asked to free.
type releaseRequest struct {
	ip, pool      string
	owner, ifName string
	node          string
	dryRun, force bool
}

func (a *app) releaseCmd() *cobra.Command {
	var r releaseRequest
	cmd := &cobra.Command{
		Use:   "release (--ip IP [--pool POOL] | --owner CONTAINER-ID [--ifname IF] | --node NODE)",
		Short: "Release addresses: one IP, a container's, or every address of a node",
		Long: `Release addresses by deleting their allocation keys, each only if unchanged
since the plan was made. Addresses of a node whose node record exists (its
agent is alive) are refused unless --force: the pod may still use them.
Without --force every delete is also fenced on the node record still being
absent, so an agent that comes back in the meantime keeps its addresses.
--dry-run prints the plan and changes nothing.`,
		Example: `  kvipamctl release --ip 10.42.3.17 --pool default --dry-run
  kvipamctl release --owner 3f9a1c0e7b2d --ifname eth0
  kvipamctl release --node worker-7`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return a.release(cmd.Context(), a.stdout, r) },
	}
	f := cmd.Flags()
	f.StringVar(&r.ip, "ip", "", "the address to release")
	f.StringVar(&r.pool, "pool", "", "with --ip: the pool of the address (needed if several pools hold it)")
	f.StringVar(&r.owner, "owner", "", "release every address of this container ID")
	f.StringVar(&r.ifName, "ifname", "", "with --owner: only this interface")
	f.StringVar(&r.node, "node", "", "release every address whose record names this node")
	f.BoolVar(&r.dryRun, "dry-run", false, "print the plan, change nothing")
	f.BoolVar(&r.force, "force", false, "release addresses of a node that is alive")
	cmd.MarkFlagsMutuallyExclusive("ip", "owner", "node")
	cmd.MarkFlagsOneRequired("ip", "owner", "node")
	return cmd
}

func (a *app) release(ctx context.Context, w io.Writer, r releaseRequest) error {
	if r.pool != "" && r.ip == "" {
		return errors.New("--pool goes with --ip")
	}
	if r.ifName != "" && r.owner == "" {
		return errors.New("--ifname goes with --owner")
	}
	var addr netip.Addr
	if r.ip != "" {
		var err error
		if addr, err = netip.ParseAddr(r.ip); err != nil {
			return fmt.Errorf("parse --ip: %w", err)
		}
	}
	in, s, err := a.snapshot(ctx)
	if err != nil {
		return err
	}
	var p inspect.Plan
	switch {
	case r.ip != "":
		p, err = inspect.PlanReleaseIP(s, r.pool, addr, r.force)
	case r.owner != "":
		p, err = inspect.PlanReleaseOwner(s, r.owner, r.ifName, r.force)
	default:
		p, err = inspect.PlanReleaseNode(s, r.node, r.force)
	}
	if err != nil {
		return planError(err)
	}
	return a.apply(ctx, w, in, p, r.dryRun)
}
