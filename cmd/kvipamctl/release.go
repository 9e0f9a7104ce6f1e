package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"slices"
	"strings"

	"github.com/spf13/cobra"

	"github.com/kvipam/kvipam/allocator/inspect"
)

// releaseRequest is what release was asked to free.
type releaseRequest struct {
	ip, pool      string
	owner, ifName string
	node          string
	evidence      evidenceFlags
	dryRun, force bool
}

func (a *app) releaseCmd() *cobra.Command {
	var r releaseRequest
	cmd := &cobra.Command{
		Use:   "release (--ip IP [--pool POOL] | --owner CONTAINER-ID [--ifname IF] | --node NODE) [--confirm-gone NODE --last-seen TIME]",
		Short: "Release addresses: one IP, a container's, or every address of a node",
		Long: `Release addresses by deleting their allocation keys, each only if unchanged
since the plan was made.

Addresses of a node whose node record exists (its agent is alive) are
refused unless --force: the pod may still use them, and while it runs its
agent writes the allocation back at its next reconciler pass (every
gcInterval, 30 s by default): delete the pod to free its address. Addresses of a node
without a node record need your statement that the node is gone, as for
node remove: a node cut off from etcd for longer than its lease TTL loses
its node record too, while its pods keep using their addresses, and
releasing them would hand them to a second pod. --confirm-gone repeats the
node's name and --last-seen says when it last ran; the release is refused
when etcd shows the node alive after that time, and the statement goes
into the plan and every audit line. --force does not replace it.

Without --force every delete is also fenced on the node record still being
absent, so an agent that comes back in the meantime keeps its addresses.
An address of a sticky identity (kept for it, or its pod's) goes with the
identity's binding, once the address is gone, so its next pod gets new
addresses. --dry-run prints the plan and changes nothing.`,
		Example: `  kvipamctl release --ip 10.42.3.17 --pool default --confirm-gone worker-7 --last-seen 3h --dry-run
  kvipamctl release --owner 3f9a1c0e7b2d --ifname eth0 --confirm-gone worker-7 --last-seen 2026-01-22T07:40:00Z
  kvipamctl release --node worker-7 --confirm-gone worker-7 --last-seen 3h
  kvipamctl release --ip 10.42.3.17 --force   # a node that is alive`,
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
	r.evidence.register(cmd)
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
	return a.planAndApply(ctx, w, r.evidence, r.dryRun, func(s *inspect.Snapshot, ev inspect.Evidence) (inspect.Plan, error) {
		var p inspect.Plan
		var err error
		switch {
		case r.ip != "":
			p, err = inspect.PlanReleaseIP(s, r.pool, addr, ev, r.force)
		case r.owner != "":
			p, err = inspect.PlanReleaseOwner(s, r.owner, r.ifName, ev, r.force)
		default:
			p, err = inspect.PlanReleaseNode(s, r.node, ev, r.force)
		}
		if err == nil {
			a.warnWriteBack(s, p)
		}
		return p, err
	})
}

// warnWriteBack tells, on stderr, that a forced release of a live node's
// addresses does not last while their pods run: the node's agent
// compares its endpoints with etcd at every reconciler pass (gcInterval,
// 30 s by default; agent/reassert.go) and writes a running pod's missing
// allocation back. Only deleting the pod frees its address for good.
func (a *app) warnWriteBack(s *inspect.Snapshot, p inspect.Plan) {
	var live []string
	for _, st := range p.Steps {
		if _, ok := s.Nodes[st.Node]; ok && st.Kind == inspect.StepIP && !slices.Contains(live, st.Node) {
			live = append(live, st.Node)
		}
	}
	if len(live) == 0 {
		return
	}
	slices.Sort(live)
	fmt.Fprintf(a.stderr, "kvipamctl: warning: node %s is alive: if a pod there still runs with an address released here, its agent writes the allocation back at its next reconciler pass (every gcInterval, 30 s by default); delete the pod to free the address for good\n",
		strings.Join(live, ", "))
}
