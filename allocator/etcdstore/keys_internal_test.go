package etcdstore

import (
	"net/netip"
	"testing"

	"github.com/stretchr/testify/require"
)

// An internal test: parseIPKey has no caller outside the package.
func TestIPKeyRoundTrip(t *testing.T) {
	for _, tc := range []struct{ block, addr string }{
		{"10.0.0.64/26", "10.0.0.70"},
		{"fd00:1::100/120", "fd00:1::1ff"},
	} {
		b, a := netip.MustParsePrefix(tc.block), netip.MustParseAddr(tc.addr)
		key := IPKey("pool-1", b, a)
		gb, ga, err := parseIPKey("pool-1", key)
		require.NoError(t, err, key)
		require.Equal(t, b, gb)
		require.Equal(t, a, ga)
	}
	for _, bad := range []string{
		"/kvipam/v1/ips/pool-1/10.0.0.64-26",          // no address
		"/kvipam/v1/ips/pool-1/10.0.0.64-26/10.0.1.1", // address outside block
		"/kvipam/v1/ips/pool-1/garbage/10.0.0.65",     // bad block
		"/kvipam/v1/ips/other/10.0.0.64-26/10.0.0.65", // other pool
	} {
		_, _, err := parseIPKey("pool-1", bad)
		require.Error(t, err, bad)
	}
}
