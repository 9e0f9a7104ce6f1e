package allocator_test

import (
	"net/netip"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator"
)

// TestSpecialRangesRefused: a pool overlapping a range whose addresses
// can never be a pod's is invalid, and the error names the range and why;
// ranges next to them, and the private and shared ranges pods use, are
// fine.
func TestSpecialRangesRefused(t *testing.T) {
	refused := []struct {
		cidr, special, says string
	}{
		{"0.0.0.0/8", "0.0.0.0/8", "this network"},
		{"0.0.1.0/24", "0.0.0.0/8", "this network"},
		{"127.0.0.0/8", "127.0.0.0/8", "loopback"},
		{"127.1.0.0/16", "127.0.0.0/8", "loopback"},
		{"169.254.0.0/16", "169.254.0.0/16", "169.254.1.1"},
		{"169.254.1.0/24", "169.254.0.0/16", "gateway"},
		{"169.254.200.0/24", "169.254.0.0/16", "link-local"},
		{"224.0.0.0/4", "224.0.0.0/4", "multicast"},
		{"239.1.0.0/16", "224.0.0.0/4", "multicast"},
		{"255.255.255.255/32", "255.255.255.255/32", "broadcast"},
		{"255.255.255.0/24", "255.255.255.255/32", "broadcast"},
		{"::1/128", "::1/128", "loopback"},
		{"fe80::/10", "fe80::/10", "link-local"},
		{"fe80::/64", "fe80::/10", "fe80::ecee:eeff:feee:eeee"},
		{"febf::/112", "fe80::/10", "link-local"},
		{"ff00::/8", "ff00::/8", "multicast"},
		{"ff02::/112", "ff00::/8", "multicast"},
		// A range holding a special one overlaps it too.
		{"128.0.0.0/1", "169.254.0.0/16", "link-local"}, // the first it overlaps
		{"192.0.0.0/2", "224.0.0.0/4", "multicast"},
		{"169.0.0.0/8", "169.254.0.0/16", "link-local"},
		{"fe00::/8", "fe80::/10", "link-local"},
	}
	for _, tc := range refused {
		t.Run("refused/"+tc.cidr, func(t *testing.T) {
			c := netip.MustParsePrefix(tc.cidr)
			err := allocator.CheckSpecialRanges(c)
			require.ErrorIs(t, err, allocator.ErrInvalidPool)
			var se *allocator.SpecialRangeError
			require.ErrorAs(t, err, &se)
			require.Equal(t, c, se.CIDR)
			require.Equal(t, netip.MustParsePrefix(tc.special), se.Range.Prefix)
			require.ErrorContains(t, err, "cidr "+tc.cidr+" overlaps "+tc.special)
			require.ErrorContains(t, err, tc.says)

			// Every entry point validates the pool: pool create,
			// add-cidr, an agent's seed pools, a pool read from etcd.
			p := allocator.Pool{Name: "blue", CIDRs: []netip.Prefix{c}, BlockSizeV6: 128}
			if c.Addr().Is4() {
				p.BlockSizeV4, p.BlockSizeV6 = 32, 0
			}
			err = p.Validate()
			require.ErrorAs(t, err, &se)
			require.ErrorIs(t, err, allocator.ErrInvalidPool)
			require.ErrorContains(t, err, `validate pool "blue": `)
			require.ErrorContains(t, err, tc.says)
		})
	}

	fine := []string{
		"10.0.0.0/8", "100.64.0.0/10", "172.16.0.0/12", "192.168.0.0/16",
		"1.0.0.0/8", "126.255.255.0/24", "128.0.0.0/16", "169.253.0.0/16", "169.255.0.0/16",
		"223.255.255.0/24", "240.0.0.0/5", "255.255.255.254/32",
		"fd00::/8", "fc00::/7", "2001:db8::/32", "::2/128", "fec0::/10", "fe00::/10", "fe7f::/16",
	}
	for _, s := range fine {
		t.Run("fine/"+s, func(t *testing.T) {
			require.NoError(t, allocator.CheckSpecialRanges(netip.MustParsePrefix(s)))
		})
	}

	t.Run("listed", func(t *testing.T) {
		var got []string
		for _, r := range allocator.SpecialRanges() {
			require.NotEmpty(t, r.Name, r.Prefix)
			require.NotEmpty(t, r.Why, r.Prefix)
			got = append(got, r.Prefix.String())
		}
		require.Equal(t, []string{"0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4", "255.255.255.255/32",
			"::1/128", "fe80::/10", "ff00::/8"}, got)
	})
}

// TestSpecialRangeKeptOnUpdate: a pool written before special ranges
// were refused can still be changed (disabled, its cidr removed) without
// adding one; adding one is refused.
func TestSpecialRangeKeptOnUpdate(t *testing.T) {
	old := allocator.Pool{Name: "old", CIDRs: pfxs("10.0.0.0/24", "169.254.0.0/24"), BlockSizeV4: 26}
	disabled := old
	disabled.Disabled = true
	require.NoError(t, allocator.CheckPoolUpdate(old, disabled), "disable a pool that already overlaps")

	added := old
	added.CIDRs = pfxs("10.0.0.0/24", "169.254.0.0/24", "127.0.0.0/24")
	err := allocator.CheckPoolUpdate(old, added)
	var se *allocator.SpecialRangeError
	require.ErrorAs(t, err, &se)
	require.Equal(t, pfx("127.0.0.0/24"), se.CIDR)

	fresh := allocator.Pool{Name: "blue", CIDRs: pfxs("10.0.0.0/24"), BlockSizeV4: 26}
	next := fresh
	next.CIDRs = pfxs("10.0.0.0/24", "169.254.0.0/24")
	require.ErrorAs(t, allocator.CheckPoolUpdate(fresh, next), &se, "add-cidr of a special range")
	require.ErrorContains(t, allocator.CheckPoolUpdate(fresh, next), "169.254.1.1")
}
