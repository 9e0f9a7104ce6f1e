package main

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator"
)

// TestPoolOpCommands drives reserve, unreserve, disable, enable, add-cidr,
// remove-cidr and delete through the command line, and pool show's view
// of them.
func TestPoolOpCommands(t *testing.T) {
	h := newHarness(t)
	h.withSmallPool()
	require.Contains(t, h.ok("pool", "reserve", "small", "10.20.0.1-10.20.0.9", "--reason", "routers"), "pool small: reserved 10.20.0.1-10.20.0.9")
	h.ok("pool", "reserve", "small", "10.20.0.240/28")
	code, _, errs := h.run("pool", "reserve", "small", "10.20.0.5")
	require.Equal(t, exitError, code)
	require.Contains(t, errs, "reserved ranges 10.20.0.1-10.20.0.9 and 10.20.0.5 overlap")
	code, _, errs = h.run("pool", "reserve", "small", "10.99.0.1")
	require.Equal(t, exitError, code)
	require.Contains(t, errs, "not inside one cidr of the pool")

	var d poolDetail
	require.Equal(t, exitOK, h.json(&d, "pool", "show", "small"))
	require.Len(t, d.Pool.Reserved, 2)
	require.Equal(t, "routers", d.Pool.Reserved[0].Reason)
	require.Equal(t, uint64(9+15), d.Usage[0].ReservedRanges, "the /28's broadcast address is never handed out anyway")
	require.Equal(t, "230", d.Usage[0].Free.String())
	out := h.ok("pool", "show", "small")
	require.Contains(t, out, "10.20.0.1-10.20.0.9")
	require.Contains(t, out, "routers")

	h.ok("pool", "unreserve", "small", "10.20.0.240/28")
	code, _, errs = h.run("pool", "unreserve", "small", "10.20.0.240/28")
	require.Equal(t, exitError, code)
	require.Contains(t, errs, "pool small has no reservation 10.20.0.240/28 (it has: 10.20.0.1-10.20.0.9)")

	n1 := h.agent("n1")
	n1.Allocate(t, "small", 0, 2, false)
	require.Contains(t, h.ok("pool", "disable", "small"), "pool small: disabled")
	require.Contains(t, h.ok("pool", "show", "small"), "disabled: hands out no new addresses")
	code, _, errs = h.run("pool", "delete", "small")
	require.Equal(t, exitError, code)
	require.Contains(t, errs, "delete pool small: pool in use: 2 addresses allocated, 1 blocks claimed")
	require.Contains(t, h.ok("pool", "show", "small"), "held by node n1")
	h.ok("pool", "enable", "small")

	require.Contains(t, h.ok("pool", "add-cidr", "small", "10.21.0.0/24"), "pool small: added 10.21.0.0/24")
	h.ok("pool", "remove-cidr", "small", "10.21.0.0/24")
	code, _, errs = h.run("pool", "remove-cidr", "small", "10.20.0.0/24")
	require.Equal(t, exitError, code)
	require.Contains(t, errs, "it is the pool's last cidr; delete the pool instead")

	var p allocator.Pool
	require.Equal(t, exitOK, h.json(&p, "pool", "create", "empty", "--cidr", "10.22.0.0/24"))
	require.Contains(t, h.ok("pool", "delete", "empty"), "pool empty: deleted")
	code, _, errs = h.run("pool", "show", "empty")
	require.Equal(t, exitError, code)
	require.Contains(t, errs, "pool not found")
}
