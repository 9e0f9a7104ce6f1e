package agent

import (
	"cmp"
	"net/netip"
	"slices"

	"github.com/kvipam/kvipam/allocator"
)

// Egress masquerade: a pod that sends to an address outside every pool
// leaves its node with the node's address as its source, where nothing
// outside the cluster routes the pool (routing host-gw or vxlan). Which
// pods, and to where, is each pool's setting in etcd (Pool.Masquerade,
// unset: the routing mode decides, egressDefault); the node's kernel
// does the translation (egressnft.go), for the routes and the eBPF
// datapath alike (docs/design.md, "Egress").
//
// This file is the pure part: what the rules say, from the pools and the
// agent's configuration. The nftables programmer (egressnft.go) makes the
// kernel say it, and the watch (egresswatch.go) keeps it up to date.

// egressPlan is what the node's masquerade rules say: a packet whose
// source is in src (a masquerading pool's CIDRs) and whose destination
// is not in keep (every pool's CIDRs, so that pods keep their addresses
// between nodes, and the operator's egress.nonMasqueradeCIDRs) leaves
// with the node's address. Each list is sorted, disjoint and not
// adjacent (merged), one per family, as an nftables interval set wants.
type egressPlan struct {
	srcV4, srcV6   []allocator.AddrRange
	keepV4, keepV6 []allocator.AddrRange
}

// empty reports whether no pool masquerades: the node then has no rules.
func (p egressPlan) empty() bool { return len(p.srcV4) == 0 && len(p.srcV6) == 0 }

// egressDefault is whether a pool that sets no masquerade masquerades
// under a routing mode: with host-gw and vxlan nothing outside the
// cluster routes pod addresses; with bgp the fabric does, and with none
// the network does by definition.
func egressDefault(routing string) bool {
	return routing == RoutingHostGW || routing == RoutingVXLAN
}

// planEgress is the plan for pools (every pool in etcd, disabled ones
// too: their pods still run), each masquerading by its setting or else
// by def, and never the destinations in never.
func planEgress(pools []allocator.Pool, def bool, never []netip.Prefix) egressPlan {
	var src, keep []allocator.AddrRange
	for _, p := range pools {
		for _, c := range p.CIDRs {
			keep = append(keep, allocator.RangeOf(c))
			if p.MasqueradeOr(def) {
				src = append(src, allocator.RangeOf(c))
			}
		}
	}
	for _, c := range never {
		keep = append(keep, allocator.RangeOf(c))
	}
	var plan egressPlan
	plan.srcV4, plan.srcV6 = mergeRanges(src, allocator.IPv4), mergeRanges(src, allocator.IPv6)
	if !plan.empty() {
		plan.keepV4, plan.keepV6 = mergeRanges(keep, allocator.IPv4), mergeRanges(keep, allocator.IPv6)
	}
	return plan
}

// mergeRanges is the ranges of rs of family f, sorted, with overlapping
// and adjacent ranges merged: an operator's CIDR may overlap a pool's,
// and the kernel refuses overlapping intervals in one set.
func mergeRanges(rs []allocator.AddrRange, f allocator.Family) []allocator.AddrRange {
	var out []allocator.AddrRange
	for _, r := range rs {
		if allocator.FamilyOf(r.First) == f {
			out = append(out, r)
		}
	}
	slices.SortFunc(out, func(a, b allocator.AddrRange) int { return cmp.Or(a.First.Compare(b.First), a.Last.Compare(b.Last)) })
	merged := out[:0]
	for _, r := range out {
		if n := len(merged); n > 0 {
			last := &merged[n-1]
			if next := last.Last.Next(); !next.IsValid() || r.First.Compare(next) <= 0 {
				if r.Last.Compare(last.Last) > 0 {
					last.Last = r.Last
				}
				continue
			}
		}
		merged = append(merged, r)
	}
	return merged
}

// rangeStrings are rs as a person reads them in a log line.
func rangeStrings(rs []allocator.AddrRange) []string {
	out := make([]string, len(rs))
	for i, r := range rs {
		out[i] = rangeText(r)
	}
	return out
}

// rangeText is r as the prefix it is, when it is one, else first-last.
func rangeText(r allocator.AddrRange) string {
	for bits := 0; bits <= r.First.BitLen(); bits++ {
		p := netip.PrefixFrom(r.First, bits)
		if p.Masked() == p && allocator.RangeOf(p) == r {
			return p.String()
		}
	}
	return r.First.String() + "-" + r.Last.String()
}
