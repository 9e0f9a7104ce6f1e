package main

import (
	"context"
	"fmt"
	"io"
	"maps"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/inspect"
	"github.com/kvipam/kvipam/allocator/records"
)

// Block sizes pool create uses for a family that has CIDRs when the flag
// is not given: 64 addresses per IPv4 block, 256 per IPv6 block.
const (
	defaultBlockV4 = 26
	defaultBlockV6 = 120
)

func (a *app) poolCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "pool", Short: "Create, change, drain, delete, list and show pools"}
	var cidrs []string
	var v4, v6 int
	var selector string
	var cooldown time.Duration
	var masquerade string
	create := &cobra.Command{
		Use:   "create NAME --cidr CIDR [--cidr CIDR]... [--node-selector SELECTOR] [--reuse-cooldown DURATION] [--masquerade on|off|default]",
		Short: "Create a pool, or add CIDRs to an existing one",
		Long: `Create a pool. Running it again with the same spec is a no-op; with more
CIDRs it adds them. Block sizes and existing CIDRs cannot change, since
claims and allocation keys name blocks of the first size.

--node-selector chooses the nodes that take blocks from the pool by their
labels (an agent's --node-labels), as Kubernetes equality selectors are
written: "rack=r1", "zone=a,gpu", "rack!=r3", "!spot". Without it the
pool serves every node; pool select changes it later.

--reuse-cooldown is how long a released address is not handed out again
while another is free, by every node alike (default 30s; 0 reuses at
once); pool set-cooldown changes it later. Running create again without
it keeps the pool's.

--masquerade says whether a pod's traffic to an address outside every
pool leaves with its node's address as its source: on, off, or default
(on with routing host-gw or vxlan, whose pod addresses nothing outside
the cluster routes; off with bgp, whose pod addresses the fabric routes); pool
set-masquerade changes it later, and create again without it keeps it.`,
		Example: "  kvipamctl pool create default --cidr 10.42.0.0/16 --cidr fd00:42::/64\n  kvipamctl pool create rack-r1 --cidr 10.50.0.0/20 --node-selector rack=r1",
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			bs4, bs6 := -1, -1
			if cmd.Flags().Changed("block-size-v4") {
				bs4 = v4
			}
			if cmd.Flags().Changed("block-size-v6") {
				bs6 = v6
			}
			p := allocator.Pool{Name: args[0], NodeSelector: selector}
			if cmd.Flags().Changed("reuse-cooldown") {
				p.ReuseCooldown = allocator.DurationOf(cooldown)
			}
			if cmd.Flags().Changed("masquerade") {
				m, err := allocator.ParseMasquerade(masquerade)
				if err != nil {
					return err
				}
				p.Masquerade = m
			}
			return a.poolCreate(cmd.Context(), a.stdout, p, cidrs, bs4, bs6)
		},
	}
	create.Flags().StringVar(&selector, "node-selector", "", "labels of the nodes the pool serves (rack=r1,zone=a); default every node")
	create.Flags().StringArrayVar(&cidrs, "cidr", nil, "a CIDR of the pool, IPv4 or IPv6; repeat for more")
	create.Flags().DurationVar(&cooldown, "reuse-cooldown", allocator.DefaultReuseCooldown, "how long a released address is not handed out again while another is free, on every node (0: reuse at once)")
	create.Flags().StringVar(&masquerade, "masquerade", "default", "masquerade pods' traffic to addresses outside every pool: on, off, or default (the routing mode decides: on for host-gw and vxlan, off for bgp)")
	create.Flags().IntVar(&v4, "block-size-v4", defaultBlockV4, "prefix length of IPv4 blocks")
	create.Flags().IntVar(&v6, "block-size-v6", defaultBlockV6, "prefix length of IPv6 blocks")
	_ = create.MarkFlagRequired("cidr")

	list := &cobra.Command{
		Use:   "list",
		Short: "List pools with their address usage",
		Args:  cobra.NoArgs,
		RunE:  func(cmd *cobra.Command, _ []string) error { return a.poolList(cmd.Context(), a.stdout) },
	}
	show := &cobra.Command{
		Use:   "show NAME",
		Short: "Show a pool's utilisation per address family",
		Args:  cobra.ExactArgs(1),
		RunE:  func(cmd *cobra.Command, args []string) error { return a.poolShow(cmd.Context(), a.stdout, args[0]) },
	}
	cmd.AddCommand(create, list, show)
	cmd.AddCommand(a.bindingCmds()...)
	cmd.AddCommand(a.poolOpCmds()...)
	return cmd
}

// poolCreate stores pool p (its name and selector) with cidrs. A block
// size of -1 means "not given": the default for a family with CIDRs,
// else none.
func (a *app) poolCreate(ctx context.Context, w io.Writer, p allocator.Pool, cidrs []string, bs4, bs6 int) error {
	name := p.Name
	for _, c := range cidrs {
		pfx, err := netip.ParsePrefix(strings.TrimSpace(c))
		if err != nil {
			return fmt.Errorf("parse --cidr %q: %w", c, err)
		}
		p.CIDRs = append(p.CIDRs, pfx)
	}
	p.BlockSizeV4 = blockSize(p, allocator.IPv4, bs4, defaultBlockV4)
	p.BlockSizeV6 = blockSize(p, allocator.IPv6, bs6, defaultBlockV6)
	var got allocator.Pool
	var serving []string
	err := a.withStore(ctx, func(s operatorStore) (err error) {
		if got, err = s.EnsurePool(ctx, p); err != nil {
			return err
		}
		serving, err = servingNodes(ctx, s, got)
		return err
	})
	if err != nil {
		return fmt.Errorf("create pool %s: %w", name, err)
	}
	a.warnUnserved(got, serving, "")
	return a.render(w, got, func(tw io.Writer) {
		row(tw, "NAME", "CIDRS", "BLOCK-V4", "BLOCK-V6", "NODE-SELECTOR", "REUSE-COOLDOWN", "MASQUERADE")
		row(tw, got.Name, joinPrefixes(got.CIDRs), sizeCell(got.BlockSizeV4), sizeCell(got.BlockSizeV6), selectorCell(got.NodeSelector), cooldownCell(got), masqueradeCell(got))
	})
}

// servingNodes names the live nodes that take new addresses in p now.
func servingNodes(ctx context.Context, s nodeLister, p allocator.Pool) ([]string, error) {
	nodes, err := s.ListNodes(ctx)
	if err != nil {
		return nil, err
	}
	return etcdstore.ServingNodes(p, nodes), nil
}

// warnUnserved warns on stderr when no live node serves p: a pod that
// asks for it fails until one does. what says who asks ("" for none).
func (a *app) warnUnserved(p allocator.Pool, serving []string, what string) {
	if len(serving) > 0 || p.Disabled {
		return
	}
	if what != "" {
		what = "; " + what + " fail until one does"
	}
	fmt.Fprintf(a.stderr, "kvipamctl: warning: no live node serves pool %s (node selector %s)%s; kvipamctl pool show %s lists the nodes it serves\n",
		p.Name, selectorCell(p.NodeSelector), what, p.Name)
}

// cooldownCell is a pool's reuse cooldown as pool show prints it.
func cooldownCell(p allocator.Pool) string {
	switch {
	case p.ReuseCooldown == nil:
		return p.Cooldown().String() + " (default)"
	case p.Cooldown() == 0:
		return "0s (reuse at once)"
	}
	return p.Cooldown().String()
}

// masqueradeCell is a pool's masquerade setting as pool show prints it.
func masqueradeCell(p allocator.Pool) string {
	if p.Masquerade == nil {
		return "default (on with routing host-gw or vxlan, off with bgp)"
	}
	return p.MasqueradeSetting()
}

// selectorCell is a node selector as pool show prints it.
func selectorCell(sel string) string {
	if sel == "" {
		return "(every node)"
	}
	return strconv.Quote(sel)
}

func blockSize(p allocator.Pool, f allocator.Family, given, def int) int {
	switch {
	case given >= 0:
		return given
	case len(p.CIDRsOf(f)) > 0:
		return def
	default:
		return 0
	}
}

// poolEntry is one pool in pool list's JSON.
type poolEntry struct {
	allocator.Pool
	Usage []inspect.PoolUsage `json:"usage"`
}

func (a *app) poolList(ctx context.Context, w io.Writer) error {
	_, s, err := a.snapshot(ctx)
	if err != nil {
		return err
	}
	usage := inspect.Usage(s, "")
	out := []poolEntry{}
	for _, u := range usage {
		if len(out) == 0 || out[len(out)-1].Name != u.Pool {
			out = append(out, poolEntry{Pool: s.Pools[u.Pool].Pool})
		}
		out[len(out)-1].Usage = append(out[len(out)-1].Usage, u)
	}
	// The columns use pool show's words: PENDING counts the reservations
	// of unfinished ADDs, RESERVED the addresses of reserved ranges.
	return a.render(w, out, func(tw io.Writer) {
		row(tw, "NAME", "STATE", "FAMILY", "CIDRS", "BLOCK", "ADDRESSES", "ALLOCATED", "PENDING", "RESERVED", "FREE", "BLOCKS", "CLAIMED", "ORPHANED")
		for _, u := range usage {
			row(tw, u.Pool, poolState(s.Pools[u.Pool].Pool), u.Family, joinPrefixes(u.CIDRs), sizeCell(u.BlockSize), addressCount(u.Addresses),
				u.Allocated, u.Reserved, uintCount(u.ReservedRanges), addressCount(u.Free),
				uintCount(u.Blocks), u.Claimed, u.Orphaned)
		}
	})
}

// poolDetail is pool show's JSON.
type poolDetail struct {
	Pool     allocator.Pool `json:"pool"`
	Revision int64          `json:"revision"`
	// Nodes are the live nodes the pool serves now: those whose labels
	// its node selector chooses (none while it is disabled).
	Nodes []string `json:"nodes"`
	// ReuseCooldown is the pool's reuse cooldown, the default when its
	// spec sets none ("30s").
	ReuseCooldown string `json:"reuseCooldown"`
	// Masquerade is the pool's masquerade setting: on, off or default
	// (the routing mode decides).
	Masquerade string              `json:"masquerade"`
	Usage      []inspect.PoolUsage `json:"usage"`
	// Exhausted says, per family with no free address, what an ADD is
	// told: why, and whether it is temporary.
	Exhausted map[string]string `json:"exhausted,omitempty"`
	// Sticky are the pool's sticky identities (kvipamctl claim list).
	Sticky []inspect.BindingRec `json:"sticky,omitempty"`
	// Draining is what is left in each draining cidr (drain-cidr).
	Draining []drainStatus `json:"draining,omitempty"`
}

func (a *app) poolShow(ctx context.Context, w io.Writer, name string) error {
	_, s, err := a.snapshot(ctx)
	if err != nil {
		return err
	}
	p, ok := s.Pools[name]
	if !ok {
		return fmt.Errorf("pool %q: %w", name, records.ErrPoolNotFound)
	}
	var live []etcdstore.NodeRecord
	for _, n := range s.Nodes {
		live = append(live, n.NodeRecord)
	}
	d := poolDetail{Pool: p.Pool, Revision: s.Revision, Usage: inspect.Usage(s, name), Nodes: etcdstore.ServingNodes(p.Pool, live),
		ReuseCooldown: p.Cooldown().String(), Masquerade: p.MasqueradeSetting()}
	for _, b := range s.Bindings {
		if b.Pool == name {
			d.Sticky = append(d.Sticky, b)
		}
	}
	if len(p.Draining) > 0 {
		err := a.withStore(ctx, func(st operatorStore) error {
			for _, c := range p.Draining {
				ds, err := drainProgress(ctx, st, p.Pool, c)
				if err != nil {
					return err
				}
				d.Draining = append(d.Draining, ds)
			}
			return nil
		})
		if err != nil {
			return err
		}
	}
	for _, u := range d.Usage {
		if u.Free.Sign() > 0 {
			continue
		}
		f, _ := allocator.ParseFamily(u.Family)
		err := a.withStore(ctx, func(st operatorStore) error {
			why, err := explainExhausted(ctx, st, name, p.Pool, f)
			if err != nil {
				return err
			}
			if d.Exhausted == nil {
				d.Exhausted = map[string]string{}
			}
			d.Exhausted[u.Family] = why
			return nil
		})
		if err != nil {
			return err
		}
	}
	return a.render(w, d, func(tw io.Writer) {
		row(tw, "Pool:", p.Name)
		row(tw, "CIDRs:", joinPrefixes(p.CIDRs))
		state := poolState(p.Pool)
		if err := p.Validate(); err != nil {
			state += ": agents serve nothing new from it: " + err.Error()
		} else if p.Disabled {
			state += ": hands out no new addresses"
		}
		row(tw, "State:", state)
		for _, ds := range d.Draining {
			left := fmt.Sprintf("%d blocks claimed, %d addresses in use", ds.Left.Claimed, ds.Left.Addresses)
			if ds.Done {
				left = "nothing left: remove-cidr takes it out"
			}
			row(tw, "Draining:", ds.CIDR.String(), left)
		}
		row(tw, "Node selector:", selectorCell(p.NodeSelector))
		nodes := strings.Join(d.Nodes, ", ")
		if nodes == "" {
			nodes = "none: a pod that asks for this pool fails"
		}
		row(tw, "Serving nodes:", nodes)
		row(tw, "Cooldown:", cooldownCell(p.Pool))
		row(tw, "Max blocks:", maxBlocksCell(p.Pool)+" per node and family")
		row(tw, "Masquerade:", masqueradeCell(p.Pool))
		for _, r := range p.Reserved {
			row(tw, "Reserved:", r.Range.String(), r.Reason)
		}
		for _, b := range d.Sticky {
			holder := "kept (no pod) for up to " + b.Window().String()
			if !b.Kept() {
				holder = "held by " + b.Owner.Key() + " on " + b.Node
			}
			row(tw, "Sticky:", b.Identity, joinAddrs(b.Addrs), holder)
		}
		for _, u := range d.Usage {
			fmt.Fprintln(tw)
			row(tw, u.Family+":", fmt.Sprintf("%s in blocks of %s", joinPrefixes(u.CIDRs), sizeCell(u.BlockSize)))
			row(tw, "  addresses", addressCount(u.Addresses))
			row(tw, "  allocated", u.Allocated)
			row(tw, "  pending", u.Reserved, "reservations of unfinished ADDs")
			row(tw, "  borrowed across blocks", u.Borrowed)
			row(tw, "  reserved", uintCount(u.ReservedRanges), "in the reserved ranges")
			row(tw, "  kept for sticky identities", u.Kept)
			row(tw, "  sticky identities", u.Bindings)
			row(tw, "  free", addressCount(u.Free))
			row(tw, "  blocks", uintCount(u.Blocks))
			row(tw, "  claimed", u.Claimed)
			row(tw, "  orphaned", u.Orphaned)
			row(tw, "  free blocks", uintCount(u.FreeBlocks))
			for _, n := range slices.Sorted(maps.Keys(u.Holders)) {
				row(tw, "  held by node "+n, u.Holders[n])
			}
			if why, ok := d.Exhausted[u.Family]; ok {
				row(tw, "  exhausted", why)
			}
		}
	})
}

// poolState is "refused": the spec is invalid (a pool written before a
// rule that refuses it, such as a special range), and agents hand out
// nothing new from it; "disabled" (pool disable: no new addresses),
// "draining" (enabled, with a cidr draining: drain-cidr) or "enabled".
func poolState(p allocator.Pool) string {
	switch {
	case p.Validate() != nil:
		return "refused"
	case p.Disabled:
		return "disabled"
	case len(p.Draining) > 0:
		return "draining"
	}
	return "enabled"
}

func joinPrefixes(ps []netip.Prefix) string {
	s := make([]string, len(ps))
	for i, p := range ps {
		s[i] = p.String()
	}
	return strings.Join(s, ",")
}

func sizeCell(bits int) string {
	if bits == 0 {
		return "-"
	}
	return fmt.Sprintf("/%d", bits)
}

func joinAddrs(as []netip.Addr) string {
	s := make([]string, len(as))
	for i, a := range as {
		s[i] = a.String()
	}
	return strings.Join(s, ",")
}

// explainExhausted says why family f of pool p, stored as name, has no
// address left, as an ADD is told.
func explainExhausted(ctx context.Context, st exhaustionReader, name string, p allocator.Pool, f allocator.Family) (string, error) {
	snap, err := st.PoolSnapshot(ctx, name)
	if err != nil {
		return "", err
	}
	return records.ExplainExhausted(ctx, st, p, f, snap).Error(), nil
}
