package main

import (
	"context"
	"io"

	"github.com/spf13/cobra"

	"github.com/kvipam/kvipam/allocator/inspect"
)

func (a *app) nodeCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "node", Short: "List nodes and remove dead ones"}
	list := &cobra.Command{
		Use:   "list",
		Short: "List nodes: alive (node record present) or only named by claims, homes and addresses",
		Args:  cobra.NoArgs,
		RunE:  func(cmd *cobra.Command, _ []string) error { return a.nodeList(cmd.Context(), a.stdout) },
	}
	var dryRun, force bool
	remove := &cobra.Command{
		Use:   "remove NODE",
		Short: "Free the blocks of a node that is gone",
		Long: `Free the blocks of a node that is gone for good: delete its claims, the
allocations in its blocks, then the blocks' homes, so any node can claim
them again. This is the audited release of orphaned blocks (invariant 3).

Refused while the node record exists (the agent is alive) unless --force.
Every delete is fenced: if the node comes back and re-claims a block while
this runs, the rest of that block is left alone. --dry-run prints the plan
and changes nothing. Run it again after a partial failure.`,
		Example: `  kvipamctl node remove worker-7 --dry-run
  kvipamctl node remove worker-7`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.nodeRemove(cmd.Context(), a.stdout, args[0], dryRun, force)
		},
	}
	remove.Flags().BoolVar(&dryRun, "dry-run", false, "print the plan, change nothing")
	remove.Flags().BoolVar(&force, "force", false, "remove a node whose node record exists")
	cmd.AddCommand(list, remove)
	return cmd
}

func (a *app) nodeList(ctx context.Context, w io.Writer) error {
	_, s, err := a.snapshot(ctx)
	if err != nil {
		return err
	}
	rows := inspect.Nodes(s)
	return a.render(w, rows, func(tw io.Writer) {
		row(tw, "NODE", "ALIVE", "CLAIMS", "HOMES", "IPS")
		for _, r := range rows {
			row(tw, r.Node, r.Alive, r.Claims, r.Homes, r.IPs)
		}
	})
}

func (a *app) nodeRemove(ctx context.Context, w io.Writer, node string, dryRun, force bool) error {
	in, s, err := a.snapshot(ctx)
	if err != nil {
		return err
	}
	p, err := inspect.PlanNodeRemove(s, node, force)
	if err != nil {
		return planError(err)
	}
	return a.apply(ctx, w, in, p, dryRun)
}
