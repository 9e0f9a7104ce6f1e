package storetest

import (
	"fmt"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator/records"
)

// raceTests: a store is safe for concurrent use, and of writers racing
// for one claim or one address exactly one wins; the others lose with a
// conflict that names the winner.
var raceTests = []test{
	{"races/claim-and-address", func(t *testing.T, f *fixture) {
		const n = 8
		leases := make([]int64, n)
		for i := range leases {
			leases[i] = f.Grant(time.Minute)
		}
		var wg sync.WaitGroup
		errs := make([]error, n)
		for i := range n {
			wg.Go(func() {
				_, errs[i] = f.Store.Claim(f.ctx, "p", blockA, records.Claim{Node: fmt.Sprintf("n%d", i)}, leases[i])
			})
		}
		wg.Wait()
		winner := -1
		for i, err := range errs {
			if err == nil {
				require.Equal(t, -1, winner, "two claims won")
				winner = i
				continue
			}
			var ce *records.ClaimError
			require.ErrorAs(t, err, &ce)
		}
		require.NotEqual(t, -1, winner)
		bi, _ := f.block(t, blockA)
		node := fmt.Sprintf("n%d", winner)
		require.True(t, bi.Owned(node))
		a := addr("10.0.0.3")
		for i := range n {
			wg.Go(func() {
				_, errs[i] = f.Store.WriteIPs(f.ctx, []records.IPWrite{{Pool: "p", Block: blockA, ClaimRev: bi.ClaimRev, Addr: a, Record: f.rec(i, node, records.StateAllocated)}})
			})
		}
		wg.Wait()
		won := 0
		for _, err := range errs {
			if err == nil {
				won++
				continue
			}
			var we *records.WriteError
			require.ErrorAs(t, err, &we)
			require.Equal(t, records.WriteError{Taken: []netip.Addr{a}}, *we)
		}
		require.Equal(t, 1, won)
	}},
}
