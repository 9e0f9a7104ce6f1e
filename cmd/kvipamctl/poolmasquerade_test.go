package main

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
)

// TestPoolMasqueradeCommands: pool create --masquerade and pool
// set-masquerade set a pool's egress masquerade in etcd, tri-state (on,
// off, or unset: the routing mode decides); pool show prints it; create
// again without the flag keeps it; a value that is not on, off or
// default is refused with what to give.
func TestPoolMasqueradeCommands(t *testing.T) {
	h := newHarness(t)
	var p allocator.Pool
	require.Equal(t, exitOK, h.json(&p, "pool", "create", "m", "--cidr", "10.40.0.0/24", "--masquerade", "off"))
	require.NotNil(t, p.Masquerade)
	require.False(t, *p.Masquerade)
	resp, err := h.cli.Get(context.Background(), etcdstore.PoolKey("m"))
	require.NoError(t, err)
	require.Contains(t, string(resp.Kvs[0].Value), `"masquerade":false`)
	require.Contains(t, h.ok("pool", "show", "m"), "Masquerade:     off")
	h.ok("pool", "create", "m", "--cidr", "10.40.0.0/24")
	var d poolDetail
	require.Equal(t, exitOK, h.json(&d, "pool", "show", "m"))
	require.Equal(t, "off", d.Masquerade, "create again without the flag keeps it")

	require.Contains(t, h.ok("pool", "set-masquerade", "m", "on"), "pool m: masquerade on")
	require.Equal(t, exitOK, h.json(&d, "pool", "show", "m"))
	require.Equal(t, "on", d.Masquerade)
	require.Contains(t, h.ok("pool", "set-masquerade", "m", "default"), "pool m: masquerade default (on with routing host-gw or vxlan, off with bgp)")
	var back poolDetail
	require.Equal(t, exitOK, h.json(&back, "pool", "show", "m"))
	require.Nil(t, back.Pool.Masquerade)
	require.Equal(t, "default", back.Masquerade)
	resp, err = h.cli.Get(context.Background(), etcdstore.PoolKey("m"))
	require.NoError(t, err)
	require.NotContains(t, string(resp.Kvs[0].Value), "masquerade", "unset is not written")

	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"pool", "set-masquerade", "m", "yes"}, `masquerade "yes": want on, off or default`},
		{[]string{"pool", "set-masquerade", "nope", "on"}, "pool not found"},
		{[]string{"pool", "create", "n", "--cidr", "10.42.0.0/24", "--masquerade", "always"}, `masquerade "always": want on, off or default`},
	} {
		code, _, errs := h.run(tc.args...)
		require.Equal(t, exitError, code, "%v", tc.args)
		require.Contains(t, errs, tc.want, "%v", tc.args)
	}
	require.Equal(t, exitOK, h.json(&d, "pool", "show", "m"))
	require.Equal(t, "default", d.Masquerade, "a refused change changes nothing")
}
