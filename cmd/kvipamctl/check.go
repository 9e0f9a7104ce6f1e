package main

import (
	"context"
	"fmt"
	"io"

	"github.com/spf13/cobra"
)

func (a *app) checkCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "check",
		Short: "Check kvipam's invariants; exit status 1 when something is found",
		Long: `Read the whole kvipam state at one etcd revision and report breaches of its
invariants. Kinds of findings:

  duplicate-ip         one address under two allocation keys
  duplicate-owner      one container interface holding two addresses of a family in a pool
  wrong-node           an allocation in a block claimed by (or homed at) another node
  misplaced            a key whose block is not a block of its pool, or whose address is
                       outside its block, not canonical, or never handed out
  orphaned-block       a block with allocations but no claim (its node is gone)
  dead-node-claim      a claim of a node that has no node record
  claim-without-lease  a claim that never expires
  expired-reservation  a reservation with no lease or an expired one
  leased-allocation    a confirmed allocation on a lease, which will vanish with it
  unknown-pool         a claim, home or allocation of a pool that does not exist
  undecodable          a key or value kvipam cannot read

Exit status: 0 when clean, 1 when something was found, 2 on error.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return a.check(cmd.Context(), a.stdout) },
	}
}

func (a *app) check(ctx context.Context, w io.Writer) error {
	in, s, err := a.snapshot(ctx)
	if err != nil {
		return err
	}
	r, err := in.Check(ctx, s)
	if err != nil {
		return err
	}
	err = a.render(w, r, func(tw io.Writer) {
		if !r.Clean() {
			row(tw, "KIND", "MESSAGE")
		}
		for _, f := range r.Findings {
			row(tw, f.Kind, f.Message)
			for _, k := range f.Keys {
				fmt.Fprintf(tw, "\t  %s\n", k)
			}
		}
		if r.Clean() {
			fmt.Fprintf(tw, "no problems found at revision %d (%d keys scanned)\n", r.Revision, r.Scanned)
		} else {
			fmt.Fprintf(tw, "%d problems found at revision %d (%d keys scanned)\n", len(r.Findings), r.Revision, r.Scanned)
		}
	})
	if err != nil {
		return err
	}
	if !r.Clean() {
		return exitCode(exitFindings)
	}
	return nil
}
