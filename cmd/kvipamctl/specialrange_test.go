package main

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
)

// TestPoolCreateRefusesSpecialRange: pool create and add-cidr refuse a
// cidr overlapping a special range with a non-zero exit, naming the
// range and why, and write nothing.
func TestPoolCreateRefusesSpecialRange(t *testing.T) {
	h := newHarness(t)
	code, out, errs := h.run("pool", "create", "ll", "--cidr", "169.254.0.0/16", "--block-size-v4", "26")
	require.Equal(t, exitError, code, "stdout %q", out)
	require.Contains(t, errs, "cidr 169.254.0.0/16 overlaps 169.254.0.0/16, IPv4 link-local")
	require.Contains(t, errs, "169.254.1.1")
	require.Zero(t, h.count(etcdstore.PoolsPrefix()), "nothing written")

	code, _, errs = h.run("pool", "create", "mc", "--cidr", "ff02::/112")
	require.Equal(t, exitError, code)
	require.Contains(t, errs, "overlaps ff00::/8, IPv6 multicast")

	h.withSmallPool()
	code, _, errs = h.run("pool", "add-cidr", "small", "127.0.0.0/24")
	require.Equal(t, exitError, code)
	require.Contains(t, errs, "cidr 127.0.0.0/24 overlaps 127.0.0.0/8, IPv4 loopback")
	require.NotContains(t, h.ok("pool", "show", "small"), "127.0.0.0/24", "nothing added")
	require.Contains(t, h.ok("pool", "add-cidr", "small", "100.64.0.0/24"), "pool small: added 100.64.0.0/24")
}

// TestPoolShowsRefused: a pool written to etcd before special ranges
// were refused shows as refused, with the reason, and can still be
// disabled.
func TestPoolShowsRefused(t *testing.T) {
	h := newHarness(t)
	h.put(etcdstore.PoolKey("legacy"), allocator.Pool{Name: "legacy", BlockSizeV4: 28,
		CIDRs: []netip.Prefix{netip.MustParsePrefix("10.30.0.0/24"), netip.MustParsePrefix("169.254.0.0/24")}})
	out := h.ok("pool", "show", "legacy")
	require.Contains(t, out, "refused: agents serve nothing new from it")
	require.Contains(t, out, "cidr 169.254.0.0/24 overlaps 169.254.0.0/16")
	require.Contains(t, h.ok("pool", "list"), "refused")
	require.Contains(t, h.ok("pool", "disable", "legacy"), "pool legacy: disabled")
	code, _, errs := h.run("pool", "add-cidr", "legacy", "127.0.0.0/24")
	require.Equal(t, exitError, code)
	require.Contains(t, errs, "overlaps 127.0.0.0/8")
}

// TestAgentStatusNamesRefusedPools: agent status lists each pool the
// agent refuses once, with the agent's reason.
func TestAgentStatusNamesRefusedPools(t *testing.T) {
	var b strings.Builder
	refusedPools(&b, []api.PoolStatus{
		{Pool: "default", Family: "ipv4"},
		{Pool: "legacy", Family: "ipv4", Refused: "validate pool \"legacy\": cidr 169.254.0.0/24 overlaps 169.254.0.0/16"},
		{Pool: "legacy", Family: "ipv6", Refused: "validate pool \"legacy\": cidr 169.254.0.0/24 overlaps 169.254.0.0/16"},
	})
	out := b.String()
	require.Contains(t, out, "REFUSED-POOL")
	require.Equal(t, 1, strings.Count(out, "overlaps"), "one line per pool")
	require.Contains(t, out, "overlaps 169.254.0.0/16")
	require.NotContains(t, out, "default")

	b.Reset()
	refusedPools(&b, []api.PoolStatus{{Pool: "default", Family: "ipv4"}})
	require.Empty(t, b.String(), "no section when nothing is refused")
}
