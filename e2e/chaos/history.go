// Package chaos records what a chaos run did and proves, from the whole
// history rather than a final snapshot, that no address ever had two live
// owners, that no answered ADD lost its allocation before its DEL, and
// that nothing leaked.
//
// Two sides are recorded. The workload's: every ADD and DEL with its
// owner, the addresses an ADD answered, and when each call began and
// ended. etcd's: every change of an allocation key, from a watch that
// starts at the first revision, stamped with when the recorder saw it
// (never before it happened). The checker only draws conclusions that
// hold whatever the delays: an owner surely believed it held an address
// from the end of its ADD to the start of its DEL, and an etcd change seen
// at time T happened at or before T.
package chaos

import (
	"cmp"
	"fmt"
	"net/netip"
	"slices"
	"time"
)

// Op is one call of the workload, as the workload saw it.
type Op struct {
	// Kind is "add" or "del", or "cutover": an operator's cut-over of
	// Identity's migration (kvipamctl ip migrate --cut-over), which holds
	// and releases nothing.
	Kind  string
	Owner string // containerID/ifName
	// Identity is the pod's sticky identity (namespace/name), if any,
	// and Window its window.
	Identity string
	Window   time.Duration
	// Migration, on an ADD, is the live migration the pod was marked the
	// target of (kubevirt.io/migrationJobName): the agent admits it as
	// the identity's alternate, a second owner of the addresses the
	// identity's live pod holds (migration.go).
	Migration string
	Node      string
	// Addrs are the addresses an ADD answered.
	Addrs      []netip.Addr
	Start, End time.Time
	// Err is the call's error; an op that failed holds nothing.
	Err string
}

// Change is one change of an allocation key in etcd.
type Change struct {
	Addr    netip.Addr
	Block   netip.Prefix
	Owner   string // containerID/ifName; "" for a delete or a kept record
	Node    string
	State   string // reserved, allocated, kept; "" for a delete
	Deleted bool
	// Identity is the sticky identity the record follows, if any, and
	// Alternate (AltNode) its live migration's second, non-forwarding
	// owner ("" when none).
	Identity  string
	Alternate string
	AltNode   string
	// Borrowed: the record is a node's in another node's block.
	Borrowed bool
	Rev      int64
	Seen     time.Time // when the recorder got it: at or after it happened
}

// Finding is one breach, with what names it.
type Finding struct {
	// Kind is "duplicate", "lost", "leak", "sticky", or (migration.go)
	// "forwarding", "owner".
	Kind    string
	Addr    netip.Addr
	Message string
}

func (f Finding) String() string { return f.Kind + ": " + f.Message }

// hold is an interval in which an owner surely believed it held addr:
// from the end of its ADD to the start of its first DEL (or the run's
// end).
type hold struct {
	owner, node string
	addr        netip.Addr
	from, to    time.Time
	add         Op
	hasDel      bool
}

// Holds turns the workload's ops into the intervals each owner held each
// address. end is when the run stopped; an owner never deleted holds
// until then.
func holds(ops []Op, end time.Time) []hold {
	sorted := slices.Clone(ops)
	slices.SortStableFunc(sorted, func(a, b Op) int { return a.Start.Compare(b.Start) })
	open := map[string][]int{} // owner -> indexes into out
	var out []hold
	for _, op := range sorted {
		switch op.Kind {
		case "add":
			if op.Err != "" {
				continue // a failed ADD holds nothing
			}
			for _, a := range op.Addrs {
				open[op.Owner] = append(open[op.Owner], len(out))
				out = append(out, hold{owner: op.Owner, node: op.Node, addr: a, from: op.End, to: end, add: op})
			}
		case "del":
			// Even a failed DEL (its plugin killed midway) ends the hold:
			// the runtime sent it because the pod is going, and the agent
			// may have released the address before the plugin died.
			for _, i := range open[op.Owner] {
				if op.Start.Before(out[i].to) {
					out[i].to, out[i].hasDel = op.Start, true
				}
			}
			delete(open, op.Owner)
		}
	}
	return out
}

// Check runs every check of the history: ops from the workload, changes
// from etcd, final the allocations etcd holds once the run is over and
// every TTL has passed (owner by address), end the run's end.
func Check(ops []Op, changes []Change, final map[netip.Addr]string, end time.Time) []Finding {
	hs := holds(ops, end)
	var out []Finding
	out = append(out, duplicates(hs, changes)...)
	out = append(out, lost(hs, changes)...)
	out = append(out, leaks(hs, final)...)
	out = append(out, stickyMoves(ops)...)
	slices.SortFunc(out, func(a, b Finding) int {
		return cmp.Or(cmp.Compare(a.Kind, b.Kind), a.Addr.Compare(b.Addr), cmp.Compare(a.Message, b.Message))
	})
	return out
}

// duplicates: two owners that both believed they held one address at one
// time. A sticky identity's successor and predecessor are two owners too;
// only a live migration's two pods may share (sharedByMigration).
func duplicates(hs []hold, changes []Change) []Finding {
	byAddr := map[netip.Addr][]hold{}
	for _, h := range hs {
		byAddr[h.addr] = append(byAddr[h.addr], h)
	}
	changesOf := changesByAddr(changes)
	var out []Finding
	for addr, list := range byAddr {
		slices.SortFunc(list, func(a, b hold) int { return a.from.Compare(b.from) })
		for i := range list {
			for j := i + 1; j < len(list) && list[j].from.Before(list[i].to); j++ {
				if list[i].owner == list[j].owner || sharedByMigration(list[i], list[j], changesOf[addr]) {
					continue
				}
				out = append(out, Finding{Kind: "duplicate", Addr: addr, Message: fmt.Sprintf(
					"%s held by %s on %s from %s to %s and by %s on %s from %s to %s",
					addr, list[i].owner, list[i].node, stamp(list[i].from), stamp(list[i].to),
					list[j].owner, list[j].node, stamp(list[j].from), stamp(list[j].to))})
			}
		}
	}
	return out
}

// lost: an owner's allocation gone from etcd (deleted, or another owner's
// record) while the owner still held it, seen before its DEL began. A
// live migration's pods hold the address as its owner or as its
// alternate: a record naming the pod either way is its; a record kept
// for the identity while the pod was only the alternate (its DEL not
// begun) dropped a live pod's address.
func lost(hs []hold, changes []Change) []Finding {
	byAddr := changesByAddr(changes)
	var out []Finding
	for _, h := range hs {
		cs := byAddr[h.addr]
		// The owner's record must be the key's last state before the hold
		// began, and nothing may take it away before the hold ends.
		mine, asAlt := false, false
		for _, c := range cs {
			switch {
			case !c.Deleted && (c.Owner == h.owner || c.Alternate == h.owner):
				mine, asAlt = true, c.Owner != h.owner
			case mine && c.Seen.Before(h.to) && (c.Deleted || c.State != "kept" || asAlt):
				what := "deleted"
				switch {
				case asAlt && !c.Deleted && c.State != "kept":
					what = "dropped as the migration's alternate (" + c.Owner + " on " + c.Node + " its only owner)"
				case c.State == "kept":
					what = "kept for its identity while it was the migration's alternate"
				case !c.Deleted:
					what = "given to " + c.Owner + " on " + c.Node
				}
				out = append(out, Finding{Kind: "lost", Addr: h.addr, Message: fmt.Sprintf(
					"%s of %s (ADD answered %s) was %s at revision %d, seen %s, before its DEL (%s)",
					h.addr, h.owner, stamp(h.from), what, c.Rev, stamp(c.Seen), delText(h))})
				mine = false
			case mine && c.State == "kept" && c.Seen.Before(h.to):
				mine = false // kept for its identity: its DEL came, and held ends
			}
		}
		if !mine && !h.hasDel && !slices.ContainsFunc(cs, func(c Change) bool { return c.Owner == h.owner || c.Alternate == h.owner }) {
			out = append(out, Finding{Kind: "lost", Addr: h.addr, Message: fmt.Sprintf(
				"%s was answered to %s (ADD ended %s) but etcd never held it for that owner", h.addr, h.owner, stamp(h.from))})
		}
	}
	return out
}

// changesByAddr is changes by address, each address's in revision order.
func changesByAddr(changes []Change) map[netip.Addr][]Change {
	byAddr := map[netip.Addr][]Change{}
	for _, c := range changes {
		byAddr[c.Addr] = append(byAddr[c.Addr], c)
	}
	for _, cs := range byAddr {
		slices.SortStableFunc(cs, func(a, b Change) int { return cmp.Compare(a.Rev, b.Rev) })
	}
	return byAddr
}

// leaks: an allocation etcd still holds at the end for an owner that holds
// nothing in the workload's history (its DEL finished, or its ADD failed).
func leaks(hs []hold, final map[netip.Addr]string) []Finding {
	live := map[string]bool{}
	for _, h := range hs {
		if !h.hasDel {
			live[h.owner+"@"+h.addr.String()] = true
		}
	}
	var out []Finding
	for addr, owner := range final {
		if owner == "" || live[owner+"@"+addr.String()] {
			continue
		}
		out = append(out, Finding{Kind: "leak", Addr: addr, Message: fmt.Sprintf("%s is still held by %s after the run, though that owner holds nothing", addr, owner)})
	}
	return out
}

// stickyMoves: a sticky identity's pod added within its predecessor's
// window after the predecessor's DEL gets the predecessor's addresses.
func stickyMoves(ops []Op) []Finding {
	sorted := slices.Clone(ops)
	slices.SortStableFunc(sorted, func(a, b Op) int { return a.Start.Compare(b.Start) })
	type last struct {
		addrs []netip.Addr
		owner string
		gone  time.Time // its DEL's end; zero while live
	}
	byID := map[string]*last{}
	ownerID := map[string]string{}
	var out []Finding
	for _, op := range sorted {
		if op.Err != "" {
			continue
		}
		switch op.Kind {
		case "add":
			if op.Identity == "" {
				continue
			}
			ownerID[op.Owner] = op.Identity
			prev := byID[op.Identity]
			if prev != nil && prev.owner != op.Owner && !prev.gone.IsZero() && op.End.Sub(prev.gone) < op.Window && !sameAddrs(prev.addrs, op.Addrs) {
				out = append(out, Finding{Kind: "sticky", Addr: first(op.Addrs), Message: fmt.Sprintf(
					"sticky identity %s: %s got %v at %s, within the window of %s's %v (gone %s)",
					op.Identity, op.Owner, op.Addrs, stamp(op.End), prev.owner, prev.addrs, stamp(prev.gone))})
			}
			byID[op.Identity] = &last{addrs: op.Addrs, owner: op.Owner}
		case "del":
			if id := ownerID[op.Owner]; id != "" && byID[id] != nil && byID[id].owner == op.Owner {
				byID[id].gone = op.End
			}
		}
	}
	return out
}

func sameAddrs(a, b []netip.Addr) bool {
	a, b = slices.Clone(a), slices.Clone(b)
	slices.SortFunc(a, netip.Addr.Compare)
	slices.SortFunc(b, netip.Addr.Compare)
	return slices.Equal(a, b)
}

func first(as []netip.Addr) netip.Addr {
	if len(as) == 0 {
		return netip.Addr{}
	}
	return as[0]
}

func delText(h hold) string {
	if !h.hasDel {
		return "none"
	}
	return "began " + stamp(h.to)
}

func stamp(t time.Time) string { return t.UTC().Format("15:04:05.000") }
