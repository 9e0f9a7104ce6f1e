package main

import (
	"context"
	"fmt"
	"io"
	"time"

	"github.com/spf13/cobra"

	"github.com/kvipam/kvipam/allocator/records"
)

// Sticky identities (kvipam.io/sticky, kvipam.io/ip-claim): the addresses
// a StatefulSet pod or a VM keeps across re-creation.
func (a *app) claimCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "claim", Short: "List, show and release sticky identities' addresses"}
	var pool, listPool string
	list := &cobra.Command{
		Use:   "list",
		Short: "List sticky identities: their addresses, and the pod holding them or how long they are kept",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return a.withStore(cmd.Context(), func(s operatorStore) error {
				bs, err := s.ListBindings(cmd.Context(), listPool)
				if err != nil {
					return err
				}
				return a.renderBindings(cmd.Context(), s, a.stdout, bs)
			})
		},
	}
	list.Flags().StringVar(&listPool, "pool", "", "only this pool")
	show := &cobra.Command{
		Use:   "show NAMESPACE/NAME --pool POOL",
		Short: "Show one sticky identity",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.withStore(cmd.Context(), func(s operatorStore) error {
				b, ok, err := s.GetBinding(cmd.Context(), pool, args[0])
				if err != nil {
					return err
				}
				if !ok {
					return fmt.Errorf("sticky identity %s in pool %s: %w", args[0], pool, records.ErrNotFound)
				}
				return a.renderBindings(cmd.Context(), s, a.stdout, []records.Binding{b})
			})
		},
	}
	show.Flags().StringVar(&pool, "pool", "default", "the identity's pool")
	release := &cobra.Command{
		Use:   "release NAMESPACE/NAME --pool POOL",
		Short: "Free a kept identity's addresses before its window ends (refused while a pod holds them)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.withStore(cmd.Context(), func(s operatorStore) error {
				freed, err := s.ReleaseBinding(cmd.Context(), pool, args[0])
				if err != nil {
					return err
				}
				a.auditLogger().Info("released sticky identity", "identity", args[0], "pool", pool, "ips", freed)
				fmt.Fprintf(a.stdout, "sticky identity %s: released %v\n", args[0], freed)
				return nil
			})
		},
	}
	release.Flags().StringVar(&pool, "pool", "default", "the identity's pool")
	cmd.AddCommand(list, show, release)
	return cmd
}

// bindingRow is one sticky identity in claim list's JSON.
type bindingRow struct {
	records.Binding
	Pool string `json:"pool"`
	// Holder is the pod's owner key, or "" while kept; KeptFor is the
	// time left of a kept identity's window.
	Holder  string `json:"holder,omitempty"`
	KeptFor string `json:"keptFor,omitempty"`
}

func (a *app) renderBindings(ctx context.Context, s records.LeaseReader, w io.Writer, bs []records.Binding) error {
	rows := make([]bindingRow, 0, len(bs))
	for _, b := range bs {
		r := bindingRow{Binding: b, Pool: b.Pool}
		if !b.Kept() {
			r.Holder = b.Owner.Key()
		} else if b.Lease != 0 {
			if end, err := s.LeaseExpiry(ctx, b.Lease); err == nil {
				r.KeptFor = time.Until(end).Round(time.Second).String()
			}
		}
		rows = append(rows, r)
	}
	return a.render(w, rows, func(tw io.Writer) {
		row(tw, "POOL", "IDENTITY", "ADDRESSES", "HELD BY", "NODE", "KEPT FOR", "WINDOW", "ALTERNATE")
		for _, r := range rows {
			row(tw, r.Pool, r.Identity, joinAddrs(r.Addrs), r.Holder, r.Node, r.KeptFor, r.Window().String(), alternateText(r.Alternate))
		}
	})
}
