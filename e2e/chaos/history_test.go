package chaos

import (
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

var t0 = time.Date(2026, 11, 23, 10, 0, 0, 0, time.UTC)

func at(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }

var x, y = netip.MustParseAddr("10.0.0.5"), netip.MustParseAddr("10.0.0.6")

// clean is a history without a breach: a on n1 holds x then gives it
// back; b on n2 gets x afterwards; c holds y to the end.
func clean() ([]Op, []Change, map[netip.Addr]string) {
	ops := []Op{
		{Kind: "add", Owner: "a/eth0", Node: "n1", Addrs: []netip.Addr{x}, Start: at(0), End: at(10)},
		{Kind: "add", Owner: "c/eth0", Node: "n1", Addrs: []netip.Addr{y}, Start: at(5), End: at(15)},
		{Kind: "del", Owner: "a/eth0", Node: "n1", Start: at(100), End: at(110)},
		{Kind: "add", Owner: "b/eth0", Node: "n2", Addrs: []netip.Addr{x}, Start: at(120), End: at(130)},
		{Kind: "add", Owner: "d/eth0", Node: "n2", Start: at(140), End: at(150), Err: "pool exhausted"},
	}
	changes := []Change{
		{Addr: x, Owner: "a/eth0", Node: "n1", State: "reserved", Rev: 10, Seen: at(8)},
		{Addr: y, Owner: "c/eth0", Node: "n1", State: "allocated", Rev: 11, Seen: at(12)},
		{Addr: x, Owner: "a/eth0", Node: "n1", State: "allocated", Rev: 12, Seen: at(20)},
		{Addr: x, Deleted: true, Rev: 20, Seen: at(105)},
		{Addr: x, Owner: "b/eth0", Node: "n2", State: "allocated", Rev: 21, Seen: at(128)},
	}
	return ops, changes, map[netip.Addr]string{x: "b/eth0", y: "c/eth0"}
}

func TestCheckerCleanHistory(t *testing.T) {
	ops, changes, final := clean()
	require.Empty(t, Check(ops, changes, final, at(1000)))
}

// TestCheckerCatchesOverlap: b's ADD answered x while a still held it
// (a's DEL came later): a duplicate naming the address, both owners and
// their times.
func TestCheckerCatchesOverlap(t *testing.T) {
	ops, changes, final := clean()
	ops[3].Start, ops[3].End = at(50), at(60) // b's ADD before a's DEL
	fs := Check(ops, changes, final, at(1000))
	require.NotEmpty(t, fs)
	require.Equal(t, "duplicate", fs[0].Kind)
	require.Equal(t, x, fs[0].Addr)
	require.Equal(t, "10.0.0.5 held by a/eth0 on n1 from 10:00:00.010 to 10:00:00.100 and by b/eth0 on n2 from 10:00:00.060 to 10:00:01.000", fs[0].Message)
}

// TestCheckerCatchesLostAllocation: etcd deleted c's y while c held it
// (no DEL of c was ever sent): lost, naming the revision and times.
func TestCheckerCatchesLostAllocation(t *testing.T) {
	ops, changes, final := clean()
	changes = append(changes, Change{Addr: y, Deleted: true, Rev: 30, Seen: at(300)})
	delete(final, y)
	fs := Check(ops, changes, final, at(1000))
	require.Len(t, fs, 1)
	require.Equal(t, "lost", fs[0].Kind)
	require.Equal(t, "10.0.0.6 of c/eth0 (ADD answered 10:00:00.015) was deleted at revision 30, seen 10:00:00.300, before its DEL (none)", fs[0].Message)

	// An answered address etcd never held for its owner is lost too.
	ops, changes, final = clean()
	changes = changes[:1]
	fs = Check(ops, changes, map[netip.Addr]string{}, at(1000))
	require.Contains(t, kinds(fs), "lost")
}

// TestCheckerKilledDelEndsHold: a DEL whose plugin was killed midway
// failed, yet the agent may have released the address already; the
// runtime tore the pod down when it sent that DEL, so the hold ends at
// its start, and the release seen before the retried DEL is no loss.
func TestCheckerKilledDelEndsHold(t *testing.T) {
	ops, changes, final := clean()
	ops = append(ops, Op{Kind: "del", Owner: "a/eth0", Node: "n1", Start: at(90), End: at(97), Err: "signal: killed"})
	changes[3].Seen = at(96) // released by the killed DEL
	require.Empty(t, Check(ops, changes, final, at(1000)))
}

// TestCheckerCatchesLeak: after the run etcd still holds x for a, whose
// DEL finished long ago.
func TestCheckerCatchesLeak(t *testing.T) {
	ops, changes, final := clean()
	final[netip.MustParseAddr("10.0.0.9")] = "a/eth0"
	fs := Check(ops, changes, final, at(1000))
	require.Len(t, fs, 1)
	require.Equal(t, "leak", fs[0].Kind)
	require.Equal(t, "10.0.0.9 is still held by a/eth0 after the run, though that owner holds nothing", fs[0].Message)
}

// TestCheckerCatchesStickyMiss: a sticky identity's next pod, inside the
// window, got another address.
func TestCheckerCatchesStickyMiss(t *testing.T) {
	ops := []Op{
		{Kind: "add", Owner: "w1/eth0", Identity: "ns/web-0", Window: time.Minute, Node: "n1", Addrs: []netip.Addr{x}, Start: at(0), End: at(10)},
		{Kind: "del", Owner: "w1/eth0", Node: "n1", Start: at(100), End: at(110)},
		{Kind: "add", Owner: "w2/eth0", Identity: "ns/web-0", Window: time.Minute, Node: "n2", Addrs: []netip.Addr{y}, Start: at(200), End: at(210)},
	}
	changes := []Change{
		{Addr: x, Owner: "w1/eth0", Node: "n1", State: "allocated", Rev: 5, Seen: at(9)},
		{Addr: x, State: "kept", Node: "n1", Rev: 6, Seen: at(105)},
		{Addr: y, Owner: "w2/eth0", Node: "n2", State: "allocated", Rev: 7, Seen: at(209)},
	}
	fs := Check(ops, changes, map[netip.Addr]string{y: "w2/eth0"}, at(1000))
	require.Len(t, fs, 1)
	require.Equal(t, "sticky", fs[0].Kind)
	require.Contains(t, fs[0].Message, "sticky identity ns/web-0: w2/eth0 got [10.0.0.6]")
	ops[2].Addrs = []netip.Addr{x}
	changes[2].Addr = x
	require.Empty(t, Check(ops, changes, map[netip.Addr]string{x: "w2/eth0"}, at(1000)), "the same address: fine")
}

func kinds(fs []Finding) []string {
	var out []string
	for _, f := range fs {
		out = append(out, f.Kind)
	}
	return out
}
