package main

import (
	"context"
	"fmt"
	"io"
	"net/netip"
	"slices"
	"strings"

	"github.com/spf13/cobra"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/records"
)

// Retiring one CIDR of a pool while the pool serves on: drain-cidr marks
// it draining in the pool's spec, agents stop handing out addresses and
// claiming blocks there and give its empty blocks back as its pods go,
// and drain-cidr (run again) or pool show says what is left; remove-cidr
// then takes it out.
func (a *app) drainCmds() []*cobra.Command {
	drain := &cobra.Command{
		Use:   "drain-cidr POOL CIDR",
		Short: "Stop handing out addresses in one CIDR of a pool, which serves on from its others; shows what is left",
		Long: `Mark a CIDR of a pool draining. Agents follow at once, without a
restart: no node claims a block there or hands out a new address from it
(not even a free one in a block it holds), a static request for an
address there is refused, and new pods get addresses from the pool's
other CIDRs. Pods that hold addresses there keep them; as they go, each
emptied block goes back to the pool. A sticky identity's kept address
there is its own: its next pod takes it back (release the identity with
kvipamctl claim release to move it).

The pool must keep a CIDR of the same family that is not draining (add
one first with add-cidr). Running drain-cidr again shows what is left,
and has the agents give back the blocks that emptied without a release
(a sticky identity's window ended); once nothing is left, remove-cidr
takes the CIDR out. undrain-cidr cancels the drain.`,
		Example: "  kvipamctl pool add-cidr default 10.43.0.0/16\n  kvipamctl pool drain-cidr default 10.42.0.0/16\n  kvipamctl pool remove-cidr default 10.42.0.0/16",
		Args:    cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := parseCIDRArg(args[1])
			if err != nil {
				return err
			}
			return a.drainCIDR(cmd.Context(), args[0], c)
		},
	}
	undrain := &cobra.Command{
		Use:   "undrain-cidr POOL CIDR",
		Short: "Cancel a drain: let a draining CIDR hand out addresses again",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := parseCIDRArg(args[1])
			if err != nil {
				return err
			}
			return a.changePool(cmd.Context(), args[0], "undrained "+c.String()+": it hands out addresses again", func(p *allocator.Pool) error { return p.Undrain(c) })
		},
	}
	return []*cobra.Command{drain, undrain}
}

func parseCIDRArg(s string) (netip.Prefix, error) {
	c, err := netip.ParsePrefix(strings.TrimSpace(s))
	if err != nil {
		return netip.Prefix{}, fmt.Errorf("parse cidr %q: %w", s, err)
	}
	return c, nil
}

// drainStatus is drain-cidr's answer: what is left in the cidr.
type drainStatus struct {
	Pool     string            `json:"pool"`
	CIDR     netip.Prefix      `json:"cidr"`
	Revision int64             `json:"revision"`
	Left     etcdstore.CIDRUse `json:"left"`
	// Reserved are the pool's reserved ranges inside the cidr, which
	// remove-cidr drops only when told (--drop-reservations).
	Reserved []allocator.Reservation `json:"reserved,omitempty"`
	// Sticky are the sticky identities with addresses in the cidr.
	Sticky []string `json:"sticky,omitempty"`
	// Done: nothing is left, remove-cidr takes the cidr out.
	Done bool `json:"done"`
}

// drainCIDR marks c of pool name draining (again, if it is already) and
// shows what is left in it.
func (a *app) drainCIDR(ctx context.Context, name string, c netip.Prefix) error {
	return a.withStore(ctx, func(s operatorStore) error {
		before, err := s.GetPool(ctx, name)
		if err != nil {
			return err
		}
		// Written again when it drains already: the agents follow the
		// write and give back the blocks that emptied without a release
		// (a sticky identity's window ended).
		p, err := s.UpdatePool(ctx, name, func(p *allocator.Pool) error { return p.Drain(c) })
		if err != nil {
			return err
		}
		if slices.Contains(before.Draining, c) {
			fmt.Fprintf(a.stderr, "kvipamctl: pool %s: %s drains already; the agents give back the blocks emptied since (revision %d)\n", name, c, p.Rev)
		} else {
			fmt.Fprintf(a.stderr, "kvipamctl: pool %s: draining %s (revision %d): no new addresses there; new pods get addresses from %s\n",
				name, c, p.Rev, joinPrefixes(p.ServingCIDRsOf(allocator.FamilyOf(c.Addr()))))
		}
		st, err := drainProgress(ctx, s, p, c)
		if err != nil {
			return err
		}
		return a.render(a.stdout, st, func(tw io.Writer) { drainRows(tw, st) })
	})
}

// drainProgress reads what is left in cidr c of pool p.
func drainProgress(ctx context.Context, s operatorStore, p allocator.Pool, c netip.Prefix) (drainStatus, error) {
	use, err := s.CIDRUse(ctx, p.Name, c)
	if err != nil {
		return drainStatus{}, err
	}
	st := drainStatus{Pool: p.Name, CIDR: c, Revision: p.Rev, Left: use, Done: !use.Any()}
	for _, r := range p.Reserved {
		if c.Contains(r.Range.First) {
			st.Reserved = append(st.Reserved, r)
		}
	}
	bs, err := s.ListBindings(ctx, p.Name)
	if err != nil {
		return drainStatus{}, err
	}
	for _, b := range bs {
		if slices.ContainsFunc(b.Addrs, c.Contains) {
			st.Sticky = append(st.Sticky, stickyCell(b))
		}
	}
	return st, nil
}

func stickyCell(b records.Binding) string {
	if b.Kept() {
		return b.Identity + " " + joinAddrs(b.Addrs) + " (kept; its next pod takes them back)"
	}
	return b.Identity + " " + joinAddrs(b.Addrs) + " (held by " + b.Owner.Key() + " on " + b.Node + ")"
}

func drainRows(tw io.Writer, st drainStatus) {
	row(tw, "Pool:", st.Pool)
	row(tw, "Draining:", st.CIDR.String())
	row(tw, "Blocks claimed:", st.Left.Claimed)
	row(tw, "Blocks with a home:", st.Left.Homes)
	row(tw, "Addresses in use:", st.Left.Addresses)
	if len(st.Left.Nodes) > 0 {
		row(tw, "Nodes:", strings.Join(st.Left.Nodes, ", "))
	}
	for _, s := range st.Sticky {
		row(tw, "Sticky:", s)
	}
	for _, r := range st.Reserved {
		row(tw, "Reserved:", r.Range.String(), r.Reason, "(remove-cidr drops it only with --drop-reservations)")
	}
	if st.Done {
		row(tw, "Done:", fmt.Sprintf("nothing left; kvipamctl pool remove-cidr %s %s takes it out", st.Pool, st.CIDR))
	} else {
		row(tw, "Done:", "no: wait for the pods there to go (kvipamctl ip list --pool "+st.Pool+" shows them)")
	}
}
