package chaos

import (
	"fmt"
	"net/netip"
	"slices"
	"time"
)

// HomeChange is one change of a block's home in etcd: the node the
// block belongs to (Deleted: the block was given back).
type HomeChange struct {
	Block   netip.Prefix
	Node    string
	Deleted bool
	Rev     int64
}

// Placement checks that every allocation etcd held was in a block whose
// home was its node at that revision, or was written as borrowed.
func Placement(changes []Change, homes []HomeChange) []Finding {
	byBlock := map[netip.Prefix][]HomeChange{}
	for _, h := range homes {
		byBlock[h.Block] = append(byBlock[h.Block], h)
	}
	for b := range byBlock {
		slices.SortFunc(byBlock[b], func(x, y HomeChange) int { return int(x.Rev - y.Rev) })
	}
	var out []Finding
	for _, c := range changes {
		if c.Deleted || c.Borrowed || c.State == "kept" || !c.Block.IsValid() {
			continue
		}
		home := ""
		for _, h := range byBlock[c.Block] {
			if h.Rev > c.Rev {
				break
			}
			home = h.Node
			if h.Deleted {
				home = ""
			}
		}
		if home != c.Node {
			out = append(out, Finding{Kind: "misplaced", Addr: c.Addr, Message: fmt.Sprintf(
				"%s of %s on node %s was written at revision %d into block %s, whose home was %q, and not as borrowed",
				c.Addr, c.Owner, c.Node, c.Rev, c.Block, home)})
		}
	}
	return out
}

// Interval is one ended ownership interval as IP history keeps it.
type Interval struct {
	Addr       netip.Addr
	Owner      string
	Start, End time.Time
	Reason     string
}

// History checks IP history against the workload: every address an
// owner held and gave back with a DEL has its intervals in the history,
// which cover its hold from before its ADD answered to no sooner than its
// DEL began, and every interval in the history is of an owner the
// workload had. A live migration's pod has several intervals (as the
// owner, as the alternate, migrated at the cut-over, alternate-ended);
// IP history keeps an alternate's time only when it ends as the
// alternate (its DEL, a failed migration), not when a cut-over makes it
// the owner, so a pod of a migrated identity is held to its last
// interval: begun before its DEL, ended no sooner.
func History(ops []Op, intervals []Interval, end time.Time) []Finding {
	have := map[string][]Interval{}
	for _, iv := range intervals {
		k := iv.Owner + "@" + iv.Addr.String()
		have[k] = append(have[k], iv)
	}
	migrated := map[string]bool{}
	for _, op := range ops {
		if op.Kind == "add" && op.Migration != "" && op.Identity != "" {
			migrated[op.Identity] = true
		}
	}
	var out []Finding
	for _, h := range holds(ops, end) {
		if !h.hasDel {
			continue
		}
		ivs := have[h.owner+"@"+h.addr.String()]
		if len(ivs) == 0 {
			out = append(out, Finding{Kind: "history", Addr: h.addr, Message: fmt.Sprintf(
				"IP history has no interval of %s for %s, which held it from %s and was deleted from %s", h.addr, h.owner, stamp(h.from), stamp(h.to))})
			continue
		}
		from := h.from
		if migrated[h.add.Identity] {
			from = h.to
		}
		if !covered(ivs, from, h.to) {
			iv := ivs[0]
			out = append(out, Finding{Kind: "history", Addr: h.addr, Message: fmt.Sprintf(
				"IP history has %s for %s from %s to %s (%s), which does not cover its hold from %s (ADD answered) to %s (DEL began)",
				h.addr, h.owner, stamp(iv.Start), stamp(iv.End), iv.Reason, stamp(h.from), stamp(h.to))})
		}
	}
	owners := map[string]bool{}
	for _, op := range ops {
		if op.Kind == "add" {
			owners[op.Owner] = true
		}
	}
	for _, iv := range intervals {
		if !owners[iv.Owner] {
			out = append(out, Finding{Kind: "history", Addr: iv.Addr, Message: fmt.Sprintf(
				"IP history has an interval of %s for %s (%s to %s, %s), an owner the workload never had", iv.Addr, iv.Owner, stamp(iv.Start), stamp(iv.End), iv.Reason)})
		}
	}
	return out
}

// covered reports whether ivs, joined where one begins no later than
// another ends, cover from to to.
func covered(ivs []Interval, from, to time.Time) bool {
	ivs = slices.Clone(ivs)
	slices.SortFunc(ivs, func(a, b Interval) int { return a.Start.Compare(b.Start) })
	at, reached := from, false
	for _, iv := range ivs {
		if iv.Start.After(at) {
			break
		}
		if !iv.End.Before(at) {
			at, reached = iv.End, true
		}
	}
	return reached && !at.Before(to)
}
