package agent

import (
	"net/netip"
	"testing"

	"github.com/google/nftables"
	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator"
)

func prefixes(ss ...string) []netip.Prefix {
	out := make([]netip.Prefix, len(ss))
	for i, s := range ss {
		out[i] = netip.MustParsePrefix(s)
	}
	return out
}

func ranges(ss ...string) []allocator.AddrRange {
	var out []allocator.AddrRange
	for _, s := range ss {
		r, err := allocator.ParseAddrRange(s)
		if err != nil {
			panic(err)
		}
		out = append(out, r)
	}
	return out
}

// TestPlanEgress: which sources are masqueraded and to which
// destinations never, from the pools and the routing mode: an unset pool
// follows the mode (on for host-gw and vxlan, off for bgp and none), a
// set one its setting; every pool's CIDRs and the operator's are never
// masqueraded to, merged where they overlap or touch; no masquerading
// pool, no rules.
func TestPlanEgress(t *testing.T) {
	on, off := true, false
	pods := allocator.Pool{Name: "pods", CIDRs: prefixes("10.42.0.0/16", "fd00:42::/64")}
	routed := allocator.Pool{Name: "routed", CIDRs: prefixes("10.50.0.0/24"), Masquerade: &off}
	lab := allocator.Pool{Name: "lab", CIDRs: prefixes("10.43.0.0/16")}
	never := prefixes("10.42.128.0/17", "192.168.0.0/16", "2001:db8::/32")

	plan := planEgress([]allocator.Pool{pods, routed, lab}, egressDefault(RoutingHostGW), never)
	require.Equal(t, ranges("10.42.0.0/15"), plan.srcV4, "pods and lab, adjacent, merged")
	require.Equal(t, ranges("fd00:42::/64"), plan.srcV6)
	require.Equal(t, ranges("10.42.0.0/15", "10.50.0.0/24", "192.168.0.0/16"), plan.keepV4,
		"every pool's CIDRs, the masquerading and the routed, and the operator's, merged")
	require.Equal(t, ranges("2001:db8::/32", "fd00:42::/64"), plan.keepV6)
	require.Equal(t, []string{"10.42.0.0/15", "10.50.0.0/24", "192.168.0.0/16"}, rangeStrings(plan.keepV4))

	require.Equal(t, planEgress([]allocator.Pool{pods, routed, lab}, true, never), planEgress([]allocator.Pool{pods, routed, lab}, egressDefault(RoutingVXLAN), never))
	for _, mode := range []string{RoutingBGP, RoutingNone} {
		require.True(t, planEgress([]allocator.Pool{pods, routed, lab}, egressDefault(mode), never).empty(), "%s: the network routes pod addresses", mode)
	}
	lab.Masquerade = &on
	plan = planEgress([]allocator.Pool{pods, routed, lab}, egressDefault(RoutingBGP), never)
	require.Equal(t, ranges("10.43.0.0/16"), plan.srcV4, "under bgp only a pool turned on")
	require.Empty(t, plan.srcV6)
	require.Equal(t, ranges("10.42.0.0/15", "10.50.0.0/24", "192.168.0.0/16"), plan.keepV4, "pod-to-pod keeps addresses whatever each pool says")

	require.True(t, planEgress(nil, true, never).empty())
	require.Equal(t, ranges("0.0.0.0/0"), mergeRanges(ranges("0.0.0.0/1", "128.0.0.0/1", "10.0.0.0/8"), allocator.IPv4), "up to the last address")
}

// TestIntervalElements: an interval set's elements as nft writes them:
// an interval end at the zero address first unless a range starts
// there, then each range's first address and the one after its last,
// none past the family's last address.
func TestIntervalElements(t *testing.T) {
	el := func(a string, end bool) nftables.SetElement {
		return nftables.SetElement{Key: netip.MustParseAddr(a).AsSlice(), IntervalEnd: end}
	}
	require.Equal(t, []nftables.SetElement{el("0.0.0.0", true), el("10.42.0.0", false), el("10.44.0.0", true), el("192.168.0.0", false), el("192.169.0.0", true)},
		intervalElements(ranges("10.42.0.0/15", "192.168.0.0/16"), 4))
	require.Equal(t, []nftables.SetElement{el("0.0.0.0", false), el("0.0.0.1", true), el("255.0.0.0", false)},
		intervalElements(ranges("0.0.0.0", "255.0.0.0/8"), 4))
	require.Equal(t, []nftables.SetElement{el("::", true), el("fd00:42::", false), el("fd00:42:0:1::", true)},
		intervalElements(ranges("fd00:42::/64"), 16))
	require.Empty(t, intervalElements(nil, 4), "an empty set")
	require.True(t, sameElements([]nftables.SetElement{el("10.0.0.0", false), el("0.0.0.0", true)}, []nftables.SetElement{el("0.0.0.0", true), el("10.0.0.0", false)}))
	require.False(t, sameElements([]nftables.SetElement{el("10.0.0.0", false)}, []nftables.SetElement{el("10.0.0.0", true)}))
}
