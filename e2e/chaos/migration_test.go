package chaos

import (
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

const vm = "e2e/vm0"

// migrated is a clean live migration: s on n1 holds x for identity vm;
// t on n2, the target of migration m1, is admitted as its alternate; an
// operator cuts over to t; s's DEL drops only the alternate; t holds x
// to the end.
func migrated() ([]Op, []Change, []BindingChange, Final) {
	ops := []Op{
		{Kind: "add", Owner: "s/eth0", Identity: vm, Window: time.Minute, Node: "n1", Addrs: []netip.Addr{x}, Start: at(0), End: at(10)},
		{Kind: "add", Owner: "t/eth0", Identity: vm, Window: time.Minute, Migration: "m1", Node: "n2", Addrs: []netip.Addr{x}, Start: at(100), End: at(110)},
		{Kind: "cutover", Identity: vm, Start: at(200), End: at(210)},
		{Kind: "del", Owner: "s/eth0", Node: "n1", Start: at(300), End: at(310)},
	}
	rec := func(rev int64, seen int, owner, node, alt, altNode string) Change {
		return Change{Addr: x, Owner: owner, Node: node, State: "allocated", Identity: vm, Alternate: alt, AltNode: altNode, Rev: rev, Seen: at(seen)}
	}
	changes := []Change{
		rec(10, 8, "s/eth0", "n1", "", ""),
		rec(20, 105, "s/eth0", "n1", "t/eth0", "n2"), // admitted
		rec(30, 205, "t/eth0", "n2", "s/eth0", "n1"), // cut over
		rec(40, 305, "t/eth0", "n2", "", ""),         // s's DEL: the alternate goes
	}
	bind := func(rev int64, owner, node, alt, altNode string) BindingChange {
		return BindingChange{Identity: vm, Addrs: []netip.Addr{x}, Owner: owner, Node: node, Alternate: alt, AltNode: altNode, Rev: rev, Seen: at(int(rev) * 10)}
	}
	bindings := []BindingChange{
		bind(10, "s/eth0", "n1", "", ""),
		bind(20, "s/eth0", "n1", "t/eth0", "n2"),
		bind(30, "t/eth0", "n2", "s/eth0", "n1"),
		bind(40, "t/eth0", "n2", "", ""),
	}
	final := Final{
		Records:  map[netip.Addr]Holder{x: {Owner: "t/eth0", Node: "n2", State: "allocated"}},
		Bindings: map[string]BindingChange{vm: bindings[3]},
	}
	return ops, changes, bindings, final
}

func checkAll(ops []Op, changes []Change, bindings []BindingChange, final Final) []Finding {
	fs := Check(ops, changes, final.Owners(), at(1000))
	return append(fs, Migrations(ops, changes, bindings, final, at(1000))...)
}

// TestCheckerMigrationCleanHistory: the two pods of a migration hold x at
// once, the target named the alternate: no finding; nor when the
// migration fails (the target's DEL before any cut-over) or the source's
// DEL hands over.
func TestCheckerMigrationCleanHistory(t *testing.T) {
	ops, changes, bindings, final := migrated()
	require.Empty(t, checkAll(ops, changes, bindings, final))
	require.Equal(t, MigrationCounts{Admits: 1, CutOvers: 1, Drops: 1}, CountMigrations(bindings))
	// IP history: s's interval as the owner ended at the cut-over, its
	// interval as the alternate at its DEL.
	ivs := []Interval{
		{Addr: x, Owner: "s/eth0", Start: at(5), End: at(205), Reason: "migrated"},
		{Addr: x, Owner: "s/eth0", Start: at(205), End: at(305), Reason: "alternate-ended"},
	}
	require.Empty(t, History(ops, ivs, at(1000)))
	require.Equal(t, []string{"history"}, kinds(History(ops, ivs[:1], at(1000))), "the alternate's interval missing")

	// Failed: t's DEL drops the alternate, s forwards on.
	ops, changes, bindings, final = migrated()
	ops = append(ops[:2], Op{Kind: "del", Owner: "t/eth0", Node: "n2", Start: at(300), End: at(310)})
	changes = append(changes[:2], Change{Addr: x, Owner: "s/eth0", Node: "n1", State: "allocated", Identity: vm, Rev: 30, Seen: at(305)})
	bindings = append(bindings[:2], BindingChange{Identity: vm, Addrs: []netip.Addr{x}, Owner: "s/eth0", Node: "n1", Rev: 30})
	final = Final{Records: map[netip.Addr]Holder{x: {Owner: "s/eth0", Node: "n1"}}, Bindings: map[string]BindingChange{vm: bindings[2]}}
	require.Empty(t, checkAll(ops, changes, bindings, final))

	// Handed over: s's DEL before any cut-over makes t the owner.
	ops, changes, bindings, final = migrated()
	ops = append(ops[:2], ops[3])
	changes = append(changes[:2], changes[3])
	bindings = append(bindings[:2], bindings[3])
	require.Empty(t, checkAll(ops, changes, bindings, final))
	require.Equal(t, MigrationCounts{Admits: 1, HandOvers: 1}, CountMigrations(bindings))
}

// TestCheckerCatchesMigrationDuplicate: two live pods of one address are
// a duplicate unless they are one identity's, one a migration's target,
// and etcd named it the other's alternate.
func TestCheckerCatchesMigrationDuplicate(t *testing.T) {
	for name, breach := range map[string]func(ops []Op, changes []Change){
		"no migration marker":       func(ops []Op, _ []Change) { ops[1].Migration = "" },
		"another identity":          func(ops []Op, _ []Change) { ops[1].Identity = "e2e/vm9" },
		"never named the alternate": func(_ []Op, cs []Change) { cs[1].Alternate, cs[2].Alternate = "u/eth0", "u/eth0" },
	} {
		ops, changes, _, final := migrated()
		breach(ops, changes)
		fs := Check(ops, changes, final.Owners(), at(1000))
		require.Contains(t, kinds(fs), "duplicate", name)
		for _, f := range fs {
			if f.Kind == "duplicate" {
				require.Equal(t, "10.0.0.5 held by s/eth0 on n1 from 10:00:00.010 to 10:00:00.300 and by t/eth0 on n2 from 10:00:00.110 to 10:00:01.000", f.Message, name)
			}
		}
	}
}

// TestCheckerCatchesAlternateLost: the target's alternate dropped while
// its pod ran (no DEL of it): lost, during the run and after it.
func TestCheckerCatchesAlternateLost(t *testing.T) {
	ops, changes, bindings, _ := migrated()
	ops = ops[:2] // no cut-over, no DEL
	changes = append(changes[:2], Change{Addr: x, Owner: "s/eth0", Node: "n1", State: "allocated", Identity: vm, Rev: 30, Seen: at(150)})
	bindings = append(bindings[:2], BindingChange{Identity: vm, Addrs: []netip.Addr{x}, Owner: "s/eth0", Node: "n1", Rev: 30})
	final := Final{Records: map[netip.Addr]Holder{x: {Owner: "s/eth0", Node: "n1"}}, Bindings: map[string]BindingChange{vm: bindings[2]}}
	fs := checkAll(ops, changes, bindings, final)
	require.Equal(t, []string{"lost", "lost"}, kinds(fs), "%v", fs)
	require.Equal(t, "10.0.0.5 of t/eth0 (ADD answered 10:00:00.110) was dropped as the migration's alternate (s/eth0 on n1 its only owner) at revision 30, seen 10:00:00.150, before its DEL (none)", fs[0].Message)
	require.Equal(t, `10.0.0.5 of t/eth0 (ADD answered 10:00:00.110, no DEL) names s/eth0 on n1 (alternate "") after the run, not it`, fs[1].Message)

	// Kept for the identity while the pod was only the alternate.
	changes[2] = Change{Addr: x, State: "kept", Identity: vm, Rev: 30, Seen: at(150)}
	fs = Check(ops, changes, map[netip.Addr]string{}, at(1000))
	require.Contains(t, fs[0].Message, "was kept for its identity while it was the migration's alternate at revision 30")
}

// TestCheckerCatchesAlternateLeak: after the run, a record and the
// binding still name as the alternate a target whose DEL finished.
func TestCheckerCatchesAlternateLeak(t *testing.T) {
	ops, changes, bindings, _ := migrated()
	ops = append(ops[:2], Op{Kind: "del", Owner: "t/eth0", Node: "n2", Start: at(300), End: at(310)})
	changes, bindings = changes[:2], bindings[:2]
	final := Final{Records: map[netip.Addr]Holder{x: {Owner: "s/eth0", Node: "n1", Alternate: "t/eth0"}}, Bindings: map[string]BindingChange{vm: bindings[1]}}
	fs := checkAll(ops, changes, bindings, final)
	require.Equal(t, []string{"leak", "leak", "owner"}, kinds(fs), "%v", fs)
	require.Equal(t, "10.0.0.5's record names t/eth0 as its migration's alternate after the run, though that pod holds nothing", fs[0].Message)
	require.Equal(t, "the binding of e2e/vm0 names t/eth0 after the run, though that pod holds nothing", fs[1].Message)
	require.Equal(t, `identity e2e/vm0 has live pods [s/eth0] after the run, and its binding names s/eth0 on n1 (alternate "t/eth0", revision 20)`, fs[2].Message)
}

// TestCheckerCatchesTwoForwardingOwners: at the cut-over's revision the
// binding names the target while the record still names the source: the
// routes of two nodes would forward x.
func TestCheckerCatchesTwoForwardingOwners(t *testing.T) {
	ops, changes, bindings, final := migrated()
	changes[2].Owner, changes[2].Node, changes[2].Alternate, changes[2].AltNode = "s/eth0", "n1", "t/eth0", "n2"
	fs := Migrations(ops, changes, bindings, final, at(1000))
	require.Equal(t, []string{"forwarding", "forwarding"}, kinds(fs), "%v", fs)
	require.Equal(t, `at revision 30 10.0.0.5's record names s/eth0 on n1 and the alternate t/eth0, and the binding of "e2e/vm0" names t/eth0 on n2 (alternate "s/eth0", revision 30)`, fs[0].Message)
	require.Equal(t, `at revision 30 the binding of e2e/vm0 names t/eth0 on n2 (alternate "s/eth0") and 10.0.0.5's record names s/eth0 on n1 (alternate "t/eth0", state allocated, revision 30)`, fs[1].Message)
}

// TestCheckerCatchesNoForwardingOwnerAfterRun: after the run the
// identity's live pod is neither the binding's owner nor on its node.
func TestCheckerCatchesNoForwardingOwnerAfterRun(t *testing.T) {
	ops, changes, bindings, final := migrated()
	b := final.Bindings[vm]
	b.Node = "n1" // the live owner runs on n2
	final.Bindings[vm] = b
	fs := Migrations(ops, changes, bindings, final, at(1000))
	require.Equal(t, []string{"owner"}, kinds(fs), "%v", fs)
	require.Equal(t, `identity e2e/vm0 has live pods [t/eth0] after the run, and its binding names t/eth0 on n1 (alternate "", revision 40)`, fs[0].Message)

	b.Node, b.Owner = "n2", "" // kept, while its pod runs
	final.Bindings[vm] = b
	fs = Migrations(ops, changes, bindings, final, at(1000))
	require.Equal(t, []string{"owner"}, kinds(fs), "%v", fs)
	require.Contains(t, fs[0].Message, "its binding names no pod (kept")
}
