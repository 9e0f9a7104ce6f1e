package allocator

import (
	"net/netip"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestDrainCIDR: a drain names one of the pool's cidrs, keeps a cidr of
// each family that serves, and is undone by Undrain; a block walk never
// passes a block of a draining cidr.
func TestDrainCIDR(t *testing.T) {
	a, b, v6 := netip.MustParsePrefix("10.1.0.0/26"), netip.MustParsePrefix("10.2.0.0/26"), netip.MustParsePrefix("fd00:1::/120")
	p := Pool{Name: "p", BlockSizeV4: 28, BlockSizeV6: 124, CIDRs: []netip.Prefix{a, b, v6}}

	require.ErrorIs(t, p.Drain(netip.MustParsePrefix("10.3.0.0/26")), ErrCIDRNotInPool)
	require.ErrorIs(t, p.Undrain(a), ErrCIDRNotInPool)
	require.NoError(t, p.Drain(a))
	require.NoError(t, p.Drain(a), "draining twice changes nothing")
	require.Equal(t, []netip.Prefix{a}, p.Draining)
	require.NoError(t, p.Validate())
	require.True(t, p.InDraining(netip.MustParseAddr("10.1.0.17")))
	require.False(t, p.InDraining(netip.MustParseAddr("10.2.0.17")))
	require.Equal(t, []netip.Prefix{b}, p.ServingCIDRsOf(IPv4))

	q := p
	q.Draining = append([]netip.Prefix(nil), p.Draining...)
	err := q.Drain(b)
	require.ErrorIs(t, err, ErrInvalidPool)
	require.ErrorContains(t, err, "every ipv4 cidr of the pool (10.1.0.0/26, 10.2.0.0/26) would be draining")
	require.ErrorIs(t, (&Pool{Name: "p", BlockSizeV6: 124, CIDRs: []netip.Prefix{v6}}).Drain(v6), ErrInvalidPool, "a family's only cidr")
	bad := p
	bad.Draining = []netip.Prefix{netip.MustParsePrefix("10.9.0.0/26")}
	require.ErrorIs(t, bad.Validate(), ErrInvalidPool, "a draining cidr that is not the pool's")

	w := NewBlockWalk("node-a", p, IPv4)
	seen := map[netip.Prefix]bool{}
	for {
		blk, ok := w.Next(func(x netip.Prefix) bool { return seen[x] })
		if !ok {
			break
		}
		require.False(t, a.Overlaps(blk), "walked %s, in the draining cidr", blk)
		seen[blk] = true
	}
	require.Len(t, seen, 4, "every block of the cidr that serves")

	require.NoError(t, p.Undrain(a))
	require.Nil(t, p.Draining)
	require.Len(t, p.ServingCIDRsOf(IPv4), 2)
}
