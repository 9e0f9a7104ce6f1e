package allocator

import (
	"fmt"
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

// TestBlockWalkSpreadsNodes: 1,000 nodes starting at once on a pool of
// 16,384 blocks mostly want different first blocks.
func TestBlockWalkSpreadsNodes(t *testing.T) {
	p := Pool{Name: "p", BlockSizeV4: 26, CIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/12")}}
	first := map[netip.Prefix]int{}
	for node := range 1000 {
		b, ok := NewBlockWalk(fmt.Sprintf("node-%d", node), p, IPv4).Next(func(netip.Prefix) bool { return false })
		require.True(t, ok)
		first[b]++
	}
	require.Greater(t, len(first), 950, "first choices collide no more than at random")
}
