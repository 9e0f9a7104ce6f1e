package chaos

import (
	"net/netip"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestPlacementCatchesMisplaced: an allocation written into a block whose
// home is another node, and not as borrowed, is caught; a borrowed one
// and one in the writer's own block are not.
func TestPlacementCatchesMisplaced(t *testing.T) {
	b := netip.MustParsePrefix("10.0.0.4/30")
	homes := []HomeChange{{Block: b, Node: "n1", Rev: 5}, {Block: b, Deleted: true, Rev: 50}, {Block: b, Node: "n2", Rev: 60}}
	changes := []Change{
		{Addr: x, Block: b, Owner: "a/eth0", Node: "n1", State: "allocated", Rev: 10},
		{Addr: y, Block: b, Owner: "b/eth0", Node: "n2", State: "allocated", Rev: 11, Borrowed: true},
		{Addr: x, Block: b, Owner: "c/eth0", Node: "n2", State: "allocated", Rev: 61},
	}
	require.Empty(t, Placement(changes, homes))
	changes = append(changes, Change{Addr: y, Block: b, Owner: "d/eth0", Node: "n3", State: "reserved", Rev: 70})
	fs := Placement(changes, homes)
	require.Len(t, fs, 1)
	require.Equal(t, `10.0.0.6 of d/eth0 on node n3 was written at revision 70 into block 10.0.0.4/30, whose home was "n2", and not as borrowed`, fs[0].Message)
}

// TestHistoryCatchesMissingAndForeignIntervals: IP history must have the
// interval of every address an owner gave back, covering its hold, and
// only owners the workload had.
func TestHistoryCatchesMissingAndForeignIntervals(t *testing.T) {
	ops, _, _ := clean()
	ivs := []Interval{{Addr: x, Owner: "a/eth0", Start: at(10), End: at(105), Reason: "released"}}
	require.Empty(t, History(ops, ivs, at(1000)))
	fs := History(ops, nil, at(1000))
	require.Len(t, fs, 1)
	require.Equal(t, "IP history has no interval of 10.0.0.5 for a/eth0, which held it from 10:00:00.010 and was deleted from 10:00:00.100", fs[0].Message)
	fs = History(ops, append(ivs, Interval{Addr: y, Owner: "z/eth0", Start: at(1), End: at(2), Reason: "released"}), at(1000))
	require.Len(t, fs, 1)
	require.Contains(t, fs[0].Message, "z/eth0 (10:00:00.001 to 10:00:00.002, released), an owner the workload never had")
	// An interval that ended while its owner still held the address does
	// not agree with the workload.
	fs = History(ops, []Interval{{Addr: x, Owner: "a/eth0", Start: at(10), End: at(50), Reason: "released"}}, at(1000))
	require.Len(t, fs, 1)
	require.Equal(t, "IP history has 10.0.0.5 for a/eth0 from 10:00:00.010 to 10:00:00.050 (released), which does not cover its hold from 10:00:00.010 (ADD answered) to 10:00:00.100 (DEL began)", fs[0].Message)
}
