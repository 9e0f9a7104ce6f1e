package main

import (
	"context"
	"net/netip"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/internal/testsupport/agenttest"
)

// TestDrainCIDRCommands drives drain-cidr, undrain-cidr and remove-cidr
// through the command line: bad input exits non-zero naming the cause;
// a drain shows what is left in the cidr, pool show too; remove-cidr
// waits for it to empty and names the reservations inside it before it
// drops them.
func TestDrainCIDRCommands(t *testing.T) {
	ctx := context.Background()
	h := newHarness(t)
	h.withSmallPool()
	h.ok("pool", "add-cidr", "small", "10.21.0.0/24")

	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"pool", "drain-cidr", "nosuch", "10.21.0.0/24"}, `pool "nosuch": allocator: pool not found`},
		{[]string{"pool", "drain-cidr", "small", "10.99.0.0/24"}, "drain cidr 10.99.0.0/24 of pool small: allocator: cidr not in pool: the pool's cidrs are 10.20.0.0/24, 10.21.0.0/24"},
		{[]string{"pool", "drain-cidr", "small", "10.21.0.0"}, `parse cidr "10.21.0.0"`},
		{[]string{"pool", "drain-cidr", "small"}, "accepts 2 arg(s)"},
		{[]string{"pool", "undrain-cidr", "small", "10.21.0.0/24"}, "undrain cidr 10.21.0.0/24 of pool small: allocator: cidr not in pool: draining are none"},
		{[]string{"pool", "undrain-cidr", "nosuch", "10.21.0.0/24"}, "pool not found"},
	} {
		code, _, errs := h.run(tc.args...)
		require.Equal(t, exitError, code, "%v", tc.args)
		require.Contains(t, errs, tc.want, "%v", tc.args)
	}

	n1 := h.agent("n1")
	_, err := n1.Alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: agenttest.Owner(1), IPs: []netip.Addr{netip.MustParseAddr("10.21.0.5")}})
	require.NoError(t, err)
	h.ok("pool", "reserve", "small", "10.21.0.1", "--reason", "gateway")

	code, out, errs := h.run("pool", "drain-cidr", "small", "10.21.0.0/24")
	require.Equal(t, exitOK, code, errs)
	require.Contains(t, errs, "pool small: draining 10.21.0.0/24")
	require.Contains(t, errs, "new pods get addresses from 10.20.0.0/24")
	require.Equal(t, []string{"1"}, rowValue(t, out, "Blocks claimed:"))
	require.Equal(t, []string{"1"}, rowValue(t, out, "Addresses in use:"))
	require.Equal(t, []string{"n1"}, rowValue(t, out, "Nodes:"))
	require.Contains(t, out, "gateway")
	require.Equal(t, []string{"no:"}, rowValue(t, out, "Done:"))

	code, _, errs = h.run("pool", "drain-cidr", "small", "10.20.0.0/24")
	require.Equal(t, exitError, code)
	require.Contains(t, errs, "every ipv4 cidr of the pool (10.20.0.0/24, 10.21.0.0/24) would be draining")

	show := h.ok("pool", "show", "small")
	require.Equal(t, []string{"draining"}, rowValue(t, show, "State:"))
	require.Contains(t, show, "Draining:")
	var d poolDetail
	require.Equal(t, exitOK, h.json(&d, "pool", "show", "small"))
	require.Len(t, d.Draining, 1)
	require.Equal(t, 1, d.Draining[0].Left.Addresses)
	require.Equal(t, []netip.Prefix{netip.MustParsePrefix("10.21.0.0/24")}, d.Pool.Draining)

	code, _, errs = h.run("pool", "remove-cidr", "small", "10.21.0.0/24")
	require.Equal(t, exitError, code)
	require.Contains(t, errs, "pool in use: 1 addresses allocated, 1 blocks claimed, 1 blocks with a home, by nodes n1")

	// The pod goes; the agent (following the pool) gives the block back.
	p, err := n1.Store.GetPool(ctx, "small")
	require.NoError(t, err)
	n1.Alloc.UpdatePool(p)
	_, err = n1.Alloc.Release(ctx, agenttest.Owner(1))
	require.NoError(t, err)
	code, _, errs = h.run("pool", "drain-cidr", "small", "10.21.0.0/24")
	require.Equal(t, exitOK, code, errs)
	require.Contains(t, errs, "pool small: 10.21.0.0/24 drains already; the agents give back the blocks emptied since")
	var st drainStatus
	require.Equal(t, exitOK, h.json(&st, "pool", "drain-cidr", "small", "10.21.0.0/24"))
	require.True(t, st.Done, "%+v", st)

	code, _, errs = h.run("pool", "remove-cidr", "small", "10.21.0.0/24")
	require.Equal(t, exitError, code)
	require.Contains(t, errs, "reserved ranges inside the cidr: 10.21.0.1 (gateway); unreserve them, or remove the cidr with them (--drop-reservations)")
	out = h.ok("pool", "remove-cidr", "small", "10.21.0.0/24", "--drop-reservations")
	require.Contains(t, out, "pool small: removed 10.21.0.0/24; cidrs now 10.20.0.0/24")
	require.Contains(t, out, "dropped reservation 10.21.0.1 (gateway)")
	require.Equal(t, []string{"enabled"}, rowValue(t, h.ok("pool", "show", "small"), "State:"))

	// undrain cancels a drain.
	h.ok("pool", "add-cidr", "small", "10.22.0.0/24")
	h.ok("pool", "drain-cidr", "small", "10.22.0.0/24")
	require.Contains(t, h.ok("pool", "undrain-cidr", "small", "10.22.0.0/24"), "pool small: undrained 10.22.0.0/24")
	require.Equal(t, []string{"enabled"}, rowValue(t, h.ok("pool", "show", "small"), "State:"))
}

// rowValue returns the cells after label of the first row of out that
// starts with it (drain-cidr's and pool show's unindented rows).
func rowValue(t testing.TB, out, label string) []string {
	t.Helper()
	for _, l := range strings.Split(out, "\n") {
		if rest, ok := strings.CutPrefix(l, label); ok {
			return strings.Fields(rest)[:1]
		}
	}
	require.Failf(t, "no row", "no %q row in\n%s", label, out)
	return nil
}
