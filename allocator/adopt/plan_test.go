package adopt

import (
	"errors"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
)

func testPool() allocator.Pool {
	return allocator.Pool{Name: "p", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.9.0.0/16")}, BlockSizeV4: 26, Rev: 5}
}

func al(addr, ctr, node string) Allocation {
	return Allocation{Addr: netip.MustParseAddr(addr), Owner: records.Owner{ContainerID: ctr, IfName: "eth0"}, Node: node}
}

func state() State {
	return State{Pool: testPool(), Blocks: map[netip.Prefix]records.BlockInfo{}, Held: map[netip.Addr]records.Allocation{},
		Used: map[netip.Prefix]int{}, Nodes: map[string]Node{"n1": {Lease: 11}, "n2": {Lease: 22}},
		Fences: map[string]records.BorrowFence{}, Now: time.Unix(1000, 0)}
}

// TestPlanClaimsPerBlock: each block of the source is one write, claimed
// by the node with most addresses in it; another node's addresses there
// are borrowed, once that node has a borrow fence on its live lease.
func TestPlanClaimsPerBlock(t *testing.T) {
	allocs := []Allocation{al("10.9.0.2", "a", "n1"), al("10.9.0.3", "b", "n1"), al("10.9.0.4", "c", "n2"), al("10.9.0.70", "d", "n2")}
	st := state()
	pl := Make("src", "net", allocs, st)
	require.Empty(t, pl.Refused)
	require.Equal(t, []string{"n2"}, pl.NeedFences, "n2 borrows in n1's block: it needs a fence first")
	require.Empty(t, pl.Writes)

	st.Fences["n2"] = records.BorrowFence{Rev: 7, Lease: 22}
	pl = Make("src", "net", allocs, st)
	require.Empty(t, pl.NeedFences)
	require.Len(t, pl.Writes, 2)
	w := pl.Writes[0]
	require.Equal(t, netip.MustParsePrefix("10.9.0.0/26"), w.Block)
	require.Equal(t, "n1", w.Claimant)
	require.Equal(t, int64(11), w.Lease)
	require.Zero(t, w.ClaimRev, "a new claim")
	require.Equal(t, int64(5), w.PoolRev)
	require.Len(t, w.IPs, 3)
	require.True(t, w.IPs[2].Record.Borrowed)
	require.Equal(t, "n2", w.IPs[2].Record.Node)
	require.Equal(t, "net", w.IPs[0].Record.Network)
	require.Equal(t, "src", w.IPs[0].Record.Imported)
	require.Equal(t, map[string]records.BorrowFence{"n2": {Rev: 7, Lease: 22}}, w.Borrowers)
	require.Len(t, w.Marks, 2)
	require.True(t, w.Marks[1].Borrowed)
	require.Equal(t, "n2", pl.Writes[1].Claimant)
}

// TestPlanIdempotent: addresses held already by their owner are not
// written again; a block with nothing new is done.
func TestPlanIdempotent(t *testing.T) {
	allocs := []Allocation{al("10.9.0.2", "a", "n1"), al("10.9.0.3", "b", "n1")}
	st := state()
	b := netip.MustParsePrefix("10.9.0.0/26")
	st.Blocks[b] = records.BlockInfo{Block: b, Claim: &records.Claim{Node: "n1"}, ClaimRev: 9, ClaimLease: 11}
	st.Used[b] = 1
	st.Held[netip.MustParseAddr("10.9.0.2")] = records.Allocation{Record: records.Record{Owner: allocs[0].Owner, Node: "n1"}}
	st.Marks = []records.ImportMark{{Source: "src", Node: "n1", Pool: "p", Block: b, Addrs: []netip.Addr{netip.MustParseAddr("10.9.0.2")}, Rev: 3}}
	pl := Make("src", "", allocs, st)
	require.Len(t, pl.Writes, 1)
	require.Equal(t, int64(9), pl.Writes[0].ClaimRev, "into the node's claim")
	require.Len(t, pl.Writes[0].IPs, 1)
	require.Equal(t, int64(3), pl.Writes[0].Marks[0].Rev)
	require.Len(t, pl.Writes[0].Marks[0].Addrs, 2, "the mark lists both runs' addresses")

	st.Held[netip.MustParseAddr("10.9.0.3")] = records.Allocation{Record: records.Record{Owner: allocs[1].Owner, Node: "n1"}}
	pl = Make("src", "", allocs, st)
	require.Empty(t, pl.Writes)
	require.Equal(t, "done", pl.Blocks[0].Action)
}

// TestPlanRefuses: an address kvipam gives to another owner refuses its
// block, naming both; so do a node with no live agent, a block orphaned
// or claimed on a lease that is not its node's agent's, and an address
// outside the pool.
func TestPlanRefuses(t *testing.T) {
	st := state()
	st.Held[netip.MustParseAddr("10.9.0.3")] = records.Allocation{Record: records.Record{Owner: records.Owner{ContainerID: "other", IfName: "eth0"}, Node: "n1"}}
	pl := Make("src", "", []Allocation{al("10.9.0.2", "a", "n1"), al("10.9.0.3", "b", "n1"), al("10.9.0.70", "c", "n1")}, st)
	require.Len(t, pl.Refused, 1)
	var ce *records.ImportConflictError
	require.True(t, errors.As(pl.Refused[0].Err, &ce))
	require.ErrorIs(t, pl.Refused[0].Err, records.ErrImportConflict)
	require.Contains(t, pl.Refused[0].Why, "other/eth0")
	require.Contains(t, pl.Refused[0].Why, "b/eth0")
	require.Len(t, pl.Writes, 1, "the other block goes on")
	require.Equal(t, netip.MustParsePrefix("10.9.0.64/26"), pl.Writes[0].Block)

	for name, tc := range map[string]struct {
		allocs []Allocation
		edit   func(*State)
		want   string
	}{
		"no agent": {[]Allocation{al("10.9.0.2", "a", "n9")}, func(*State) {}, "no live kvipam agent"},
		"outside":  {[]Allocation{al("10.10.0.2", "a", "n1")}, func(*State) {}, "in no CIDR"},
		"orphaned": {[]Allocation{al("10.9.0.2", "a", "n1")}, func(s *State) { s.Used[netip.MustParsePrefix("10.9.0.0/26")] = 2 }, "orphaned"},
		"stale claim": {[]Allocation{al("10.9.0.2", "a", "n1")}, func(s *State) {
			b := netip.MustParsePrefix("10.9.0.0/26")
			s.Blocks[b] = records.BlockInfo{Block: b, Claim: &records.Claim{Node: "n1"}, ClaimRev: 2, ClaimLease: 99}
		}, "not its live agent's"},
		"source twice": {[]Allocation{al("10.9.0.2", "a", "n1"), al("10.9.0.2", "b", "n1")}, func(*State) {}, "both a/eth0 and b/eth0"},
	} {
		st := state()
		tc.edit(&st)
		pl := Make("src", "", tc.allocs, st)
		require.NotEmpty(t, pl.Refused, name)
		require.Contains(t, pl.Refused[0].Why, tc.want, name)
	}
}
