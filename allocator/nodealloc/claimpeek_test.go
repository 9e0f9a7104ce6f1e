package nodealloc_test

import (
	"context"
	"net/netip"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
)

// TestLostClaimPeeksNextBlocks: when nodes start at once, a node learns
// of blocks taken since its restore only from claims that lose. After a
// lost claim it peeks at its next candidates (a read that costs no raft
// entry) and skips those another node holds, so the next claim
// transaction goes to a block that may be free: here n1's first four
// choices are n2's, and n1 claims its fifth with two claim transactions,
// not five.
func TestLostClaimPeeksNextBlocks(t *testing.T) {
	for _, tc := range []struct {
		name       string
		peekFails  bool
		wantClaims int64
	}{
		{"peek", false, 2},
		// A peek that fails costs only the claims it would have saved.
		{"peek fails", true, 5},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			e := startEtcd(t, small)
			n1, h := hooked(t, e, "n1", nodeOpts{})
			n2 := startNode(t, e, "n2", []string{"small"}, nodeOpts{})

			walk := allocator.NewBlockWalk("n1", small, allocator.IPv4)
			next := walk.Upcoming(5, func(netip.Prefix) bool { return false })
			require.Len(t, next, 5)
			for _, b := range next[:4] { // taken after n1's restore: n1 does not know
				_, err := n2.store.Claim(ctx, "small", b, records.Claim{Node: "n2"}, int64(n2.sess.ID()))
				require.NoError(t, err)
			}

			calls := countCalls(h, "Claim")
			if tc.peekFails {
				h.Before("PeekBlocks", failTimes(100, errInjected))
			}
			r, err := n1.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(1)})
			require.NoError(t, err)
			require.Equal(t, next[4], r.Allocations[0].Block, "n1's fifth choice")
			require.Equal(t, tc.wantClaims, calls["Claim"].Load(), "claim transactions")
		})
	}
}
