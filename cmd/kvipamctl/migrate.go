package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"

	"github.com/spf13/cobra"

	"github.com/kvipam/kvipam/allocator/inspect"
	"github.com/kvipam/kvipam/allocator/records"
)

// One address in full (ip show), and a live migration's cut-over by an
// operator (ip migrate --cut-over).

func (a *app) ipShowCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "show IP",
		Short: "Show one address: its owner, node, state and, during a live migration, its second owner",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			addr, err := netip.ParseAddr(args[0])
			if err != nil {
				return fmt.Errorf("%q is not an IP address", args[0])
			}
			return a.ipShow(cmd.Context(), a.stdout, addr.Unmap())
		},
	}
}

func (a *app) ipShow(ctx context.Context, w io.Writer, addr netip.Addr) error {
	_, s, err := a.snapshot(ctx)
	if err != nil {
		return err
	}
	ips, err := inspect.IPs(s, inspect.IPFilter{})
	if err != nil {
		return err
	}
	for _, ip := range ips {
		if ip.Addr != addr {
			continue
		}
		return a.render(w, ip, func(tw io.Writer) {
			pod := ip.Pod
			if pod != "" && ip.Namespace != "" {
				pod = ip.Namespace + "/" + pod
			}
			for _, kv := range [][2]any{{"Pool:", ip.Pool}, {"IP:", ip.Addr}, {"Block:", ip.Block}, {"State:", ip.State},
				{"Node:", ip.Node}, {"Owner:", ip.Owner.Key()}, {"Pod:", pod}, {"Identity:", ip.Identity}, {"Borrowed:", ip.Borrowed},
				{"Since:", ip.Since}, {"Alternate:", alternateText(ip.Alternate)}, {"Key:", ip.Key}} {
				row(tw, kv[0], kv[1])
			}
		})
	}
	return fmt.Errorf("ip %s: %w", addr, records.ErrNotFound)
}

// alternateText is a live migration's second owner in a table cell.
func alternateText(alt *records.Alternate) string {
	if alt == nil {
		return ""
	}
	pod := alt.Owner.Key()
	if alt.Owner.Pod != "" {
		pod = alt.Owner.Namespace + "/" + alt.Owner.Pod + " (" + pod + ")"
	}
	return fmt.Sprintf("%s on %s, migration %q", pod, alt.Node, alt.Migration)
}

func (a *app) ipMigrateCmd() *cobra.Command {
	var pool string
	var cutOver bool
	cmd := &cobra.Command{
		Use:   "migrate NAMESPACE/NAME --pool POOL --cut-over",
		Short: "Cut a sticky identity's live migration over to its target now",
		Long: `Cut a sticky identity's live migration over to its target pod now, as the
guest's own announcement on the target node does: one transaction makes the
target the owner its addresses route to, and the source its second,
non-forwarding owner until the source pod's DEL. Refused when the identity
has no migration in progress. kvipamctl claim show lists the alternate.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if !cutOver {
				return errors.New("ip migrate does one thing: --cut-over (say it)")
			}
			return a.withRecordingStore(cmd.Context(), func(s operatorStore) error {
				b, err := s.CutOverIdentity(cmd.Context(), pool, args[0])
				if err != nil {
					return err
				}
				a.auditLogger().Info("cut over a live migration", "identity", args[0], "pool", pool, "owner", b.Owner.Key(), "node", b.Node, "ips", b.Addrs)
				fmt.Fprintf(a.stdout, "sticky identity %s: cut over to %s on node %s %v\n", args[0], b.Owner.Key(), b.Node, b.Addrs)
				return nil
			})
		},
	}
	cmd.Flags().StringVar(&pool, "pool", "default", "the identity's pool")
	cmd.Flags().BoolVar(&cutOver, "cut-over", false, "make the migration's target forward now")
	return cmd
}
