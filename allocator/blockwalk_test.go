package allocator

import (
	"fmt"
	"math"
	"net/netip"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestBlockWalkVisitsEveryBlockOnce: a node's walk is a permutation of
// the family's blocks, whatever their number (a power of two or not,
// across several CIDRs), and differs from node to node.
func TestBlockWalkVisitsEveryBlockOnce(t *testing.T) {
	for _, tc := range []struct {
		bits  int
		cidrs []string
	}{
		{26, []string{"10.0.0.0/24"}}, {32, []string{"10.0.0.0/30"}}, {26, []string{"10.0.0.0/26"}},
		{26, []string{"10.0.0.0/24", "10.1.0.0/25", "10.2.0.0/26"}}, // 4+2+1 = 7 blocks
		{26, []string{"10.0.0.0/22", "10.9.0.0/24"}},                // 20 blocks
	} {
		cidrs := tc.cidrs
		p := Pool{Name: "p", BlockSizeV4: tc.bits}
		for _, c := range cidrs {
			p.CIDRs = append(p.CIDRs, netip.MustParsePrefix(c))
		}
		n := p.BlockCount(IPv4)
		orders := map[string]bool{}
		for node := range 8 {
			w := NewBlockWalk(fmt.Sprintf("node-%d", node), p, IPv4)
			seen := map[netip.Prefix]bool{}
			order := ""
			for i := range n {
				b, ok := w.at(i)
				require.True(t, ok)
				require.False(t, seen[b], "%v: %s twice", cidrs, b)
				seen[b] = true
				order += b.String() + " "
			}
			require.Len(t, seen, int(n))
			orders[order] = true
		}
		if n > 4 {
			require.Greater(t, len(orders), 1, "%v: every node walks the same way", cidrs)
		}
	}
}

// TestBlockWalkSpreadsNodes: nodes starting at once on a pool of 16,384
// blocks want different first blocks as often as if each chose at
// random, whatever their names look like: a shared first choice is a
// claim transaction lost to a conflict in a cold start.
func TestBlockWalkSpreadsNodes(t *testing.T) {
	p := Pool{Name: "p", BlockSizeV4: 26, CIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/12")}}
	blocks := float64(p.BlockCount(IPv4))
	for _, tc := range []struct {
		nodes int
		name  func(int) string
	}{
		{1000, func(i int) string { return fmt.Sprintf("node-%d", i) }},
		{5000, func(i int) string { return fmt.Sprintf("node-%05d", i) }},
		{5000, func(i int) string { return fmt.Sprintf("rack%02d-node%03d", i/100, i%100) }},
		{5000, func(i int) string { return fmt.Sprintf("ip-10-%d-%d-%d.ec2.internal", i>>16, (i>>8)&255, i&255) }},
	} {
		first := map[netip.Prefix]int{}
		for node := range tc.nodes {
			b, ok := NewBlockWalk(tc.name(node), p, IPv4).Next(func(netip.Prefix) bool { return false })
			require.True(t, ok)
			first[b]++
		}
		// At random: blocks * (1 - (1-1/blocks)^nodes) distinct, with a
		// standard deviation of about 20 at 5,000 nodes.
		random := blocks * (1 - math.Pow(1-1/blocks, float64(tc.nodes)))
		require.Greater(t, float64(len(first)), random-100, "%s...: %d distinct first choices of %d nodes, %.0f at random", tc.name(0), len(first), tc.nodes, random)
	}
}
