package main

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
)

// Changes to a pool an operator makes while it is in use. Every one is a
// compare-and-swap on the pool's key in etcd; agents follow the key and
// apply the change without a restart.
func (a *app) poolOpCmds() []*cobra.Command {
	var reason string
	reserve := &cobra.Command{
		Use:   "reserve POOL IP|FIRST-LAST|CIDR [--reason TEXT]",
		Short: "Keep addresses of a pool from being handed out automatically",
		Long: `Reserve an address, a range or a CIDR of a pool: agents never hand a
reserved address out by themselves; a static request (the "ips"
capability or the kvipam.io/ips annotation) may still take one, which is
what reserving it is for. Reserving an address in use takes nothing from
its pod. The range must lie in one of the pool's CIDRs.`,
		Example: "  kvipamctl pool reserve default 10.42.0.1 --reason gateway\n  kvipamctl pool reserve default 10.42.7.0/24 --reason 'load balancer VIPs'",
		Args:    cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			r, err := allocator.ParseAddrRange(args[1])
			if err != nil {
				return err
			}
			return a.changePool(cmd.Context(), args[0], "reserved "+r.String(), func(p *allocator.Pool) error {
				for _, x := range p.Reserved {
					if x.Range == r {
						return fmt.Errorf("pool %s: %s is reserved already", p.Name, r)
					}
				}
				p.Reserved = append(p.Reserved, allocator.Reservation{Range: r, Reason: reason})
				return nil
			})
		},
	}
	reserve.Flags().StringVar(&reason, "reason", "", "why, for whoever reads pool show")
	unreserve := &cobra.Command{
		Use:   "unreserve POOL IP|FIRST-LAST|CIDR",
		Short: "Remove a reservation, exactly as it was made",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			r, err := allocator.ParseAddrRange(args[1])
			if err != nil {
				return err
			}
			return a.changePool(cmd.Context(), args[0], "unreserved "+r.String(), func(p *allocator.Pool) error {
				n := len(p.Reserved)
				p.Reserved = slices.DeleteFunc(p.Reserved, func(x allocator.Reservation) bool { return x.Range == r })
				if len(p.Reserved) == n {
					return fmt.Errorf("pool %s has no reservation %s (it has: %s)", p.Name, r, reservations(p.Reserved))
				}
				return nil
			})
		},
	}
	disable := &cobra.Command{
		Use:   "disable POOL",
		Short: "Stop a pool handing out new addresses; releases go on (drain it)",
		Long: `A disabled pool hands out nothing new: an ADD that needs an address from
it fails with "pool disabled" (CNI error 102). Pods that hold addresses
keep them and release them as usual; pool show lists what is left. This
is how a pool is drained before remove-cidr or delete.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.changePool(cmd.Context(), args[0], "disabled", func(p *allocator.Pool) error { p.Disabled = true; return nil })
		},
	}
	enable := &cobra.Command{
		Use:   "enable POOL",
		Short: "Let a disabled pool hand out addresses again",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.changePool(cmd.Context(), args[0], "enabled", func(p *allocator.Pool) error { p.Disabled = false; return nil })
		},
	}
	addCIDR := &cobra.Command{
		Use:     "add-cidr POOL CIDR",
		Short:   "Add a CIDR to a pool",
		Example: "  kvipamctl pool add-cidr default 10.43.0.0/16",
		Args:    cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := netip.ParsePrefix(strings.TrimSpace(args[1]))
			if err != nil {
				return fmt.Errorf("parse cidr %q: %w", args[1], err)
			}
			return a.changePool(cmd.Context(), args[0], "added "+c.String(), func(p *allocator.Pool) error {
				if slices.Contains(p.CIDRs, c) {
					return fmt.Errorf("pool %s has cidr %s already", p.Name, c)
				}
				p.CIDRs = append(p.CIDRs, c)
				if p.BlockSize(allocator.FamilyOf(c.Addr())) == 0 {
					p.BlockSizeV4 = blockSize(*p, allocator.IPv4, -1, defaultBlockV4)
					p.BlockSizeV6 = blockSize(*p, allocator.IPv6, -1, defaultBlockV6)
				}
				return nil
			})
		},
	}
	var dropReserved bool
	removeCIDR := &cobra.Command{
		Use:   "remove-cidr POOL CIDR [--drop-reservations]",
		Short: "Take a CIDR out of a pool; refused while anything in it is allocated or claimed",
		Long: `Take a CIDR out of a pool. It is refused while any block of it is
claimed or has a home, or any address in it has a record: drain it first
(drain-cidr), which also shows what is left. Reserved ranges inside the
CIDR are named and the removal refused, unless --drop-reservations says
to drop them with it (or unreserve them first).`,
		Example: "  kvipamctl pool drain-cidr default 10.42.0.0/16\n  kvipamctl pool remove-cidr default 10.42.0.0/16 --drop-reservations",
		Args:    cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := parseCIDRArg(args[1])
			if err != nil {
				return err
			}
			return a.withStore(cmd.Context(), func(s operatorStore) error {
				before, err := s.GetPool(cmd.Context(), args[0])
				if err != nil {
					return err
				}
				p, err := s.RemoveCIDR(cmd.Context(), args[0], c, dropReserved)
				if err != nil {
					return err
				}
				fmt.Fprintf(a.stdout, "pool %s: removed %s; cidrs now %s\n", p.Name, c, joinPrefixes(p.CIDRs))
				for _, r := range before.Reserved {
					if c.Contains(r.Range.First) {
						fmt.Fprintf(a.stdout, "pool %s: dropped reservation %s\n", p.Name, etcdstore.ReservationList([]allocator.Reservation{r}))
					}
				}
				return nil
			})
		},
	}
	removeCIDR.Flags().BoolVar(&dropReserved, "drop-reservations", false, "drop the reserved ranges inside the cidr with it (they are named and the removal refused without it)")
	sel := &cobra.Command{
		Use:   "select POOL SELECTOR",
		Short: "Choose the nodes a pool serves by their labels (\"\" for every node)",
		Long: `Set the pool's node selector: the nodes whose labels (an agent's
--node-labels) it chooses take new blocks and addresses from the pool;
the others take nothing new from it, keep every address their pods hold,
and give their blocks back as they empty. A selector is written as
Kubernetes equality selectors are: comma-separated key=value, key!=value,
key (the label exists) and !key (it does not). An empty selector serves
every node. Agents follow the change without a restart.`,
		Example: "  kvipamctl pool select rack-r1 rack=r1\n  kvipamctl pool select gpu 'gpu,zone!=c'\n  kvipamctl pool select default ''",
		Args:    cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			s, err := allocator.ParseSelector(args[1])
			if err != nil {
				return err
			}
			return a.selectNodes(cmd.Context(), args[0], s)
		},
	}
	cooldown := &cobra.Command{
		Use:   "set-cooldown POOL DURATION|default",
		Short: "Set how long a released address of a pool is not handed out again",
		Long: `Set the pool's reuse cooldown: a released address is not handed out
again for this long while another address is free, by every node alike,
in its own blocks and when it borrows from another node's; when nothing
else is free the address released longest ago is. 0 reuses at once;
"default" goes back to the default (30s); at most 1h. Agents follow the
change without a restart. What to choose: docs/operations.md.`,
		Example: "  kvipamctl pool set-cooldown default 130s\n  kvipamctl pool set-cooldown batch 0\n  kvipamctl pool set-cooldown default default",
		Args:    cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			var d *allocator.Duration
			if args[1] != "default" {
				v, err := time.ParseDuration(strings.TrimSpace(args[1]))
				if err != nil {
					return fmt.Errorf("parse cooldown %q: want a duration such as 130s or 2m, 0, or default: %w", args[1], err)
				}
				if err := allocator.ValidateCooldown(v); err != nil {
					return err
				}
				d = allocator.DurationOf(v)
			}
			return a.withStore(cmd.Context(), func(s operatorStore) error {
				p, err := s.UpdatePool(cmd.Context(), args[0], func(p *allocator.Pool) error { p.ReuseCooldown = d; return nil })
				if err != nil {
					return err
				}
				fmt.Fprintf(a.stdout, "pool %s: reuse cooldown %s (revision %d)\n", p.Name, cooldownCell(p), p.Rev)
				return nil
			})
		},
	}
	masquerade := &cobra.Command{
		Use:   "set-masquerade POOL on|off|default",
		Short: "Set whether a pool's pods reach addresses outside every pool with their node's address",
		Long: `Set the pool's egress masquerade: on, a pod's packet to an address
outside every pool (and outside the agents' egress.nonMasqueradeCIDRs)
leaves its node with the node's address as its source, so that replies
find their way back where nothing routes the pool; off, it keeps the
pod's address (the network routes the pool, as a BGP fabric does).
"default" goes back to the routing mode's choice: on with host-gw and
vxlan, off with bgp. Traffic between pods, on one node or two, always
keeps pod addresses. Every agent follows the change without a restart.
What to choose: docs/routing.md, "Egress".`,
		Example: "  kvipamctl pool set-masquerade default off\n  kvipamctl pool set-masquerade default default",
		Args:    cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			m, err := allocator.ParseMasquerade(strings.TrimSpace(args[1]))
			if err != nil {
				return err
			}
			return a.withStore(cmd.Context(), func(s operatorStore) error {
				p, err := s.UpdatePool(cmd.Context(), args[0], func(p *allocator.Pool) error { p.Masquerade = m; return nil })
				if err != nil {
					return err
				}
				fmt.Fprintf(a.stdout, "pool %s: masquerade %s (revision %d)\n", p.Name, masqueradeCell(p), p.Rev)
				return nil
			})
		},
	}
	del := &cobra.Command{
		Use:   "delete POOL",
		Short: "Delete a pool; refused while anything in it is allocated, claimed or bound",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.withStore(cmd.Context(), func(s operatorStore) error {
				if err := s.DeletePool(cmd.Context(), args[0]); err != nil {
					return err
				}
				fmt.Fprintf(a.stdout, "pool %s: deleted\n", args[0])
				return nil
			})
		},
	}
	return append([]*cobra.Command{reserve, unreserve, disable, enable, addCIDR, removeCIDR, sel, cooldown, masquerade, a.maxBlocksCmd(), del}, a.drainCmds()...)
}

// selectNodes sets the pool's node selector and says which live nodes
// serve it now.
func (a *app) selectNodes(ctx context.Context, name string, sel allocator.Selector) error {
	return a.withStore(ctx, func(s operatorStore) error {
		p, err := s.UpdatePool(ctx, name, func(p *allocator.Pool) error { p.NodeSelector = sel.String(); return nil })
		if err != nil {
			return err
		}
		serving, err := servingNodes(ctx, s, p)
		if err != nil {
			return err
		}
		fmt.Fprintf(a.stdout, "pool %s: node selector %s (revision %d); serving nodes now: %s\n", p.Name, selectorCell(p.NodeSelector), p.Rev, strings.Join(serving, ", "))
		a.warnUnserved(p, serving, "")
		return nil
	})
}

// changePool applies change to a pool in etcd and says what it did.
func (a *app) changePool(ctx context.Context, name, did string, change func(p *allocator.Pool) error) error {
	return a.withStore(ctx, func(s operatorStore) error {
		p, err := s.UpdatePool(ctx, name, change)
		if err != nil {
			return err
		}
		fmt.Fprintf(a.stdout, "pool %s: %s (revision %d)\n", p.Name, did, p.Rev)
		return nil
	})
}

func reservations(rs []allocator.Reservation) string {
	if len(rs) == 0 {
		return "none"
	}
	s := make([]string, len(rs))
	for i, r := range rs {
		s[i] = r.Range.String()
	}
	return strings.Join(s, ", ")
}
