package main

import (
	"context"
	"fmt"

	"github.com/spf13/cobra"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/schema"
	"github.com/kvipam/kvipam/internal/foundation/buildinfo"
)

// downgrader lowers and holds the cluster's schema level (downgrade).
type downgrader interface {
	ValidateDowngrade(ctx context.Context, to schema.Level) ([]etcdstore.LevelInUse, error)
	EnableDowngrade(ctx context.Context, to schema.Level, version string) (etcdstore.SchemaSetting, error)
	CancelDowngrade(ctx context.Context, version string) (etcdstore.SchemaSetting, bool, error)
}

func (a *app) downgradeCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "downgrade",
		Short: "Lower the cluster's schema level before running an older release (validate, enable, cancel)",
		Long: `An agent refuses to start below the cluster's schema level, and kvipam
v0.1.0, which predates levels, must not run above level 1. Before a
rollback, lower the level to the one the older release understands:
validate says what keeps it up (a record that uses a newer feature, such
as a pool's max-blocks), enable lowers it and holds it (the agents stop
raising it), cancel lets the agents raise it again once every live node
understands more. VERSION is a release (v0.1.0) or a level (1).
docs/operations.md, "Upgrading agents (rolling)" and "Upgrading bare-metal agents".`,
	}
	validate := &cobra.Command{
		Use:   "validate VERSION",
		Short: "Say whether the cluster's level could go down to what VERSION understands, and if not what keeps it",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.withTarget(cmd.Context(), args[0], func(s operatorStore, to schema.Level) error {
				inUse, err := s.ValidateDowngrade(cmd.Context(), to)
				if err != nil {
					return err
				}
				if len(inUse) > 0 {
					return fmt.Errorf("%w: level %d is in use: %v", etcdstore.ErrSchemaLevel, to, inUse)
				}
				fmt.Fprintf(a.stdout, "the cluster can go down to level %d (%s): nothing in use needs more\n", to, args[0])
				return nil
			})
		},
	}
	enable := &cobra.Command{
		Use:   "enable VERSION",
		Short: "Lower the cluster's level to what VERSION understands and hold it there",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.withTarget(cmd.Context(), args[0], func(s operatorStore, to schema.Level) error {
				set, err := s.EnableDowngrade(cmd.Context(), to, buildinfo.Read().Version)
				if err != nil {
					return err
				}
				fmt.Fprintf(a.stdout, "schema level %d, held for a downgrade to %s: agents of it may start; kvipamctl downgrade cancel when done\n", set.Level, args[0])
				return nil
			})
		},
	}
	cancel := &cobra.Command{
		Use:   "cancel",
		Short: "Let the agents raise the cluster's level again",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return a.withStore(cmd.Context(), func(s operatorStore) error {
				set, changed, err := s.CancelDowngrade(cmd.Context(), buildinfo.Read().Version)
				if err != nil {
					return err
				}
				if !changed {
					fmt.Fprintf(a.stdout, "no downgrade holds the schema level (%d)\n", set.Level)
					return nil
				}
				fmt.Fprintf(a.stdout, "schema level %d, no longer held: the agents raise it once every live node understands more\n", set.Level)
				return nil
			})
		},
	}
	cmd.AddCommand(validate, enable, cancel)
	return cmd
}

// withTarget runs f on the store with the level a downgrade's VERSION
// argument names (a release or a level).
func (a *app) withTarget(ctx context.Context, arg string, f func(operatorStore, schema.Level) error) error {
	to, err := schema.ParseTarget(arg)
	if err != nil {
		return err
	}
	return a.withStore(ctx, func(s operatorStore) error { return f(s, to) })
}

// maxBlocksCmd is pool set-max-blocks.
func (a *app) maxBlocksCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "set-max-blocks POOL N|none",
		Short: "Set how many blocks of each family a node claims in a pool at most",
		Long: `Set the pool's maxBlocksPerNode: a node claims at most N blocks of each
family in the pool; beyond them it borrows addresses in other nodes'
blocks, and when none is free the pool is exhausted for it. Blocks a
node already holds stay. "none" removes the limit. It is schema feature
pool-max-blocks (level 2): refused while a live node does not understand
it (kvipamctl version), and a pool that sets it keeps the cluster's
level up (kvipamctl downgrade).`,
		Example: "  kvipamctl pool set-max-blocks default 4\n  kvipamctl pool set-max-blocks default none",
		Args:    cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			n := 0
			if args[1] != "none" {
				if _, err := fmt.Sscanf(args[1], "%d", &n); err != nil || n <= 0 || fmt.Sprint(n) != args[1] {
					return fmt.Errorf("max blocks %q: want a number above 0, or none", args[1])
				}
			}
			return a.withStore(cmd.Context(), func(s operatorStore) error {
				p, err := s.UpdatePool(cmd.Context(), args[0], func(p *allocator.Pool) error { p.MaxBlocksPerNode = n; return nil })
				if err != nil {
					return err
				}
				fmt.Fprintf(a.stdout, "pool %s: max blocks per node %s (revision %d)\n", p.Name, maxBlocksCell(p), p.Rev)
				return nil
			})
		},
	}
}

// maxBlocksCell is a pool's maxBlocksPerNode for tables.
func maxBlocksCell(p allocator.Pool) string {
	if p.MaxBlocksPerNode <= 0 {
		return "none"
	}
	return fmt.Sprint(p.MaxBlocksPerNode)
}
