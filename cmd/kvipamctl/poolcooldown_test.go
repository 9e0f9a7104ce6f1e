package main

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
)

// TestPoolCooldownCommands: pool create --reuse-cooldown and pool
// set-cooldown set a pool's reuse cooldown in etcd, where a person reads
// it as a duration; pool show prints it, the default when the spec sets
// none; create again without the flag keeps it; a cooldown out of range
// or not a duration is refused with what to give.
func TestPoolCooldownCommands(t *testing.T) {
	h := newHarness(t)
	var p allocator.Pool
	require.Equal(t, exitOK, h.json(&p, "pool", "create", "c", "--cidr", "10.40.0.0/24", "--reuse-cooldown", "130s"))
	require.Equal(t, 130*time.Second, p.Cooldown())
	resp, err := h.cli.Get(context.Background(), etcdstore.PoolKey("c"))
	require.NoError(t, err)
	require.Contains(t, string(resp.Kvs[0].Value), `"reuseCooldown":"2m10s"`)
	require.Contains(t, h.ok("pool", "show", "c"), "Cooldown:       2m10s")
	h.ok("pool", "create", "c", "--cidr", "10.40.0.0/24")
	var d poolDetail
	require.Equal(t, exitOK, h.json(&d, "pool", "show", "c"))
	require.Equal(t, "2m10s", d.ReuseCooldown, "create again without the flag keeps it")

	require.Contains(t, h.ok("pool", "set-cooldown", "c", "0"), "pool c: reuse cooldown 0s (reuse at once)")
	require.Equal(t, exitOK, h.json(&d, "pool", "show", "c"))
	require.Equal(t, "0s", d.ReuseCooldown)
	require.Contains(t, h.ok("pool", "set-cooldown", "c", "default"), "pool c: reuse cooldown 30s (default)")
	var back poolDetail
	require.Equal(t, exitOK, h.json(&back, "pool", "show", "c"))
	require.Nil(t, back.Pool.ReuseCooldown)
	require.Equal(t, "30s", back.ReuseCooldown)
	h.ok("pool", "create", "plain", "--cidr", "10.41.0.0/24")
	require.Contains(t, h.ok("pool", "show", "plain"), "Cooldown:       30s (default)")

	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"pool", "set-cooldown", "c", "2h"}, "reuseCooldown 2h0m0s: want 0 (reuse at once) to 1h0m0s"},
		{[]string{"pool", "set-cooldown", "c", "--", "-1s"}, "reuseCooldown -1s: want 0 (reuse at once) to 1h0m0s"},
		{[]string{"pool", "set-cooldown", "c", "soon"}, `parse cooldown "soon": want a duration such as 130s or 2m, 0, or default`},
		{[]string{"pool", "set-cooldown", "nope", "1m"}, "pool not found"},
		{[]string{"pool", "create", "d", "--cidr", "10.42.0.0/24", "--reuse-cooldown", "-5s"}, "reuseCooldown -5s: want 0 (reuse at once) to 1h0m0s"},
	} {
		code, _, errs := h.run(tc.args...)
		require.Equal(t, exitError, code, "%v", tc.args)
		require.Contains(t, errs, tc.want, "%v", tc.args)
	}
	require.Equal(t, exitOK, h.json(&d, "pool", "show", "c"))
	require.Equal(t, "30s", d.ReuseCooldown, "a refused change changes nothing")
}
