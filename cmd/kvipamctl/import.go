package main

import (
	"fmt"
	"os"

	"github.com/spf13/cobra"

	"github.com/kvipam/kvipam/allocator/adopt/hostlocal"
	"github.com/kvipam/kvipam/allocator/adopt/whereabouts"
)

// kvipamctl import: adopting a running cluster (docs/operations.md,
// "Adopting a running cluster"). The sources are read here, the plan is
// adopt.Make's, the writes etcdstore's (importrun.go).
func (a *app) importCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "import",
		Short: "Take over another IPAM's live allocations (host-local, whereabouts) without restarting a pod",
		Long: `Import another IPAM's live allocations: each becomes a kvipam record owned
by the same container ID and interface (and pod, where the source names
it), in POOL, whose CIDRs must cover them. The blocks that hold imported
addresses are claimed for the node that runs those pods, on its live
agent's lease (the agent must run there first); an address of a block
another node holds is held as borrowed. One transaction per block: its
claim, its records and the import marks the nodes' agents learn them
from. Idempotent: run it again after a crash, or after pods were added.
An address kvipam already gives to another owner refuses its whole block,
naming both owners. The source's state is not touched (see finalize).`,
	}
	var o importOpts
	hl := &cobra.Command{
		Use:   "host-local --node NODE --pool POOL --dir /var/lib/cni/networks/NET",
		Short: "Import host-local's allocations of one node (its files, read on that node)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if o.node == "" || o.dir == "" {
				return fmt.Errorf("import host-local: --node and --dir are required")
			}
			allocs, err := hostlocal.Read(o.dir, o.node)
			if err != nil {
				return err
			}
			if o.network == "" {
				o.network = hostlocal.Network(o.dir)
			}
			return a.runImport(cmd.Context(), o, hostlocal.SourceID(o.node, o.network), allocs, nil)
		},
	}
	hl.Flags().StringVar(&o.node, "node", "", "the node whose host-local state --dir is (its agent must be running)")
	hl.Flags().StringVar(&o.dir, "dir", "", "host-local's directory of the network, /var/lib/cni/networks/NET")
	wb := &cobra.Command{
		Use:   "whereabouts --pool POOL (--kubeconfig PATH | --file EXPORT.json)",
		Short: "Import whereabouts' allocations (IPPools, with the pods' nodes) from the API server or an export",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if (o.kubeconfig == "") == (o.file == "") {
				return fmt.Errorf("import whereabouts: give exactly one of --kubeconfig and --file")
			}
			var data []byte
			var err error
			if o.file != "" {
				data, err = os.ReadFile(o.file)
			} else {
				data, err = exportWhereabouts(cmd.Context(), o.kubeconfig)
			}
			if err != nil {
				return fmt.Errorf("import whereabouts: %w", err)
			}
			ex, err := whereabouts.Parse(data)
			if err != nil {
				return err
			}
			allocs, skipped, err := ex.Allocations(o.ippools)
			if err != nil {
				return err
			}
			return a.runImport(cmd.Context(), o, whereabouts.SourceID(o.pool), allocs, skipped)
		},
	}
	wb.Flags().StringVar(&o.kubeconfig, "kubeconfig", "", "read IPPools, OverlappingRangeIPReservations and pods from this cluster")
	wb.Flags().StringVar(&o.file, "file", "", "read them from this file (kubectl get ippools.whereabouts.cni.cncf.io,overlappingrangeipreservations.whereabouts.cni.cncf.io,pods -A -o json)")
	wb.Flags().StringSliceVar(&o.ippools, "ippool", nil, "import only these IPPools (by name; default every one)")
	for _, c := range []*cobra.Command{hl, wb} {
		c.Flags().StringVar(&o.pool, "pool", "", "the kvipam pool to import into (its CIDRs must cover the addresses)")
		c.Flags().StringVar(&o.network, "network", "", "the CNI network name the records carry (CNI GC of that network sees them); host-local: the directory's name")
		c.Flags().BoolVar(&o.dryRun, "dry-run", false, "print the plan, write nothing")
		_ = c.MarkFlagRequired("pool")
	}
	status := &cobra.Command{
		Use:   "status",
		Short: "What was imported, per source, node and pool; how much of it kvipam still holds; finalized or not",
		Args:  cobra.NoArgs,
		RunE:  func(cmd *cobra.Command, _ []string) error { return a.importStatus(cmd.Context()) },
	}
	var finDir string
	finalize := &cobra.Command{
		Use:   "finalize SOURCE-ID",
		Short: "End an import: drop its marks and record it finalized; with --dir, remove host-local's files of the imported addresses",
		Long: `Finalize ends an import for good: its import marks (what kvipamctl import
status lists) are dropped and the source recorded finalized. Until then
nothing of the source's state is touched and you can go back (switch the
conflist back; kvipamctl release the imported records).

With --dir (a host-local source, run on its node) the address files of
the imported addresses are removed from host-local's directory, so
host-local, were it used again, would not keep them from others. A
whereabouts source's objects are left for you to delete (kubectl delete
ippools.whereabouts.cni.cncf.io ...): kvipamctl writes nothing to the
Kubernetes API.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error { return a.importFinalize(cmd.Context(), args[0], finDir) },
	}
	finalize.Flags().StringVar(&finDir, "dir", "", "host-local's directory of the source's network: remove the imported addresses' files")
	cmd.AddCommand(hl, wb, status, finalize)
	return cmd
}

// importOpts are the flags of the import commands.
type importOpts struct {
	pool, network, node, dir string
	kubeconfig, file         string
	ippools                  []string
	dryRun                   bool
}
