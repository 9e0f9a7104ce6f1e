package main

import (
	"context"
	"io"

	"github.com/spf13/cobra"

	"github.com/kvipam/kvipam/allocator/inspect"
	"github.com/kvipam/kvipam/allocator/records"
)

// The list commands: block list and ip list. Each reads one snapshot and
// prints one row per record.

func (a *app) blockCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "block", Short: "List blocks and who owns them"}
	var pool string
	list := &cobra.Command{
		Use:   "list",
		Short: "List blocks that have a claim, a home or allocations",
		Long: `List blocks that have a claim, a home or allocations. STATE is claimed
(a live node holds it), orphaned (its node's claim expired while addresses
are still allocated: only that node, or kvipamctl node remove, can take it
back), free (no addresses; the home is stale) or unowned (addresses but
neither claim nor home). Blocks never claimed are not listed.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return a.blockList(cmd.Context(), a.stdout, pool) },
	}
	list.Flags().StringVar(&pool, "pool", "", "only blocks of this pool")
	cmd.AddCommand(list)
	return cmd
}

func (a *app) blockList(ctx context.Context, w io.Writer, pool string) error {
	_, s, err := a.snapshot(ctx)
	if err != nil {
		return err
	}
	rows := inspect.Blocks(s, pool)
	if rows == nil {
		rows = []inspect.BlockRow{}
	}
	return a.render(w, rows, func(tw io.Writer) {
		row(tw, "POOL", "BLOCK", "STATE", "NODE", "USED", "RESERVED", "CAPACITY")
		for _, r := range rows {
			row(tw, r.Pool, r.Block, r.State, r.Node, r.Used, r.Reserved, r.Capacity)
		}
	})
}

func (a *app) ipCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "ip", Short: "List allocated and reserved addresses"}
	var f inspect.IPFilter
	var state string
	list := &cobra.Command{
		Use:   "list",
		Short: "List addresses, filtered by pool, node, owner or state",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			f.State = records.State(state)
			return a.ipList(cmd.Context(), a.stdout, f)
		},
	}
	list.Flags().StringVar(&f.Pool, "pool", "", "only addresses of this pool")
	list.Flags().StringVar(&f.Node, "node", "", "only addresses of this node")
	list.Flags().StringVar(&f.Owner, "owner", "", "only addresses of this container ID")
	list.Flags().StringVar(&state, "state", "", "only addresses in this state: allocated or reserved")
	cmd.AddCommand(list, a.ipShowCmd(), a.ipHistoryCmd(), a.ipMigrateCmd())
	return cmd
}

func (a *app) ipList(ctx context.Context, w io.Writer, f inspect.IPFilter) error {
	if err := f.Validate(); err != nil {
		return err
	}
	_, s, err := a.snapshot(ctx)
	if err != nil {
		return err
	}
	ips, err := inspect.IPs(s, f)
	if err != nil {
		return err
	}
	return a.render(w, ips, func(tw io.Writer) {
		row(tw, "POOL", "IP", "STATE", "NODE", "CONTAINER", "IFNAME", "POD", "POD UID", "SINCE", "ALTERNATE")
		for _, ip := range ips {
			pod := ip.Pod
			if pod != "" && ip.Namespace != "" {
				pod = ip.Namespace + "/" + pod
			}
			row(tw, ip.Pool, ip.Addr, ip.State, ip.Node, ip.ContainerID, ip.IfName, pod, ip.PodUID, ip.Since, alternateText(ip.Alternate))
		}
	})
}
