package suggest

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestClosest(t *testing.T) {
	names := []string{"endpoints", "pool", "agentSocket", "gatewayV4", "leaseTTL", "mtu"}
	for k, want := range map[string]string{
		"endpoint": "endpoints", "pol": "pool", "agentSocekt": "agentSocket", "gatewayv4": "gatewayV4",
		"lease-ttl": "leaseTTL", "LEASE_TTL": "leaseTTL", "mttu": "mtu",
		"routing": "", "x": "", "endpointsxyzw": "",
	} {
		require.Equal(t, want, Closest(k, names), k)
	}
	require.True(t, Same("lease-ttl", "leaseTTL"))
	require.False(t, Same("lease", "leaseTTL"))
}
