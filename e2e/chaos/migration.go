package chaos

import (
	"cmp"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"time"
)

// Live migration in the history. A VM's identity is held by its source
// pod; the target pod of a migration (Op.Migration) is admitted as the
// identity's alternate, a second, non-forwarding owner of the same
// addresses, named in the binding and in each address's record; a
// cut-over makes it the owner (the one that forwards) and the source the
// alternate; either pod's DEL drops only what it holds. So two live holds
// of one address are legal only when they are one identity's pods, one of
// them a migration's target, and etcd named the one the other's
// alternate. What must hold besides:
//
//   - forwarding: at every revision of a migration's writes, the binding
//     and each of its addresses' records name one owner on one node (the
//     one the routes follow) and the same alternate;
//   - owner: after the run, an identity with a live pod is held by
//     exactly one forwarding owner, a live pod of it, on that pod's
//     node, in the binding and every record; its alternate, if any, is
//     its other live pod;
//   - lost: a live pod's address, owner or alternate, is still in etcd
//     naming it;
//   - leak: no record or binding names, as owner or alternate, a pod
//     that holds nothing.

// BindingChange is one change of a sticky identity's binding in etcd.
type BindingChange struct {
	Identity string
	Addrs    []netip.Addr
	// Owner (on Node) forwards; "" while the addresses are kept.
	Owner, Node string
	// Alternate (on AltNode) is a live migration's second owner.
	Alternate, AltNode string
	Deleted            bool
	Rev                int64
	Seen               time.Time
}

// Holder is who an allocation record names at the end of the run.
type Holder struct {
	Owner, Node, Alternate string
	State                  string
}

// Final is what etcd holds once the run is over: the allocation records
// by address, and the sticky bindings by identity.
type Final struct {
	Records  map[netip.Addr]Holder
	Bindings map[string]BindingChange
}

// Owners are the records' owners by address (Check's final).
func (f Final) Owners() map[netip.Addr]string {
	out := map[netip.Addr]string{}
	for a, h := range f.Records {
		if h.Owner != "" {
			out[a] = h.Owner
		}
	}
	return out
}

// sharedByMigration: a and b, overlapping holds of one address, are one
// identity's pods in a live migration: one of them was a migration's
// target, and etcd's record of the address named one the owner and the
// other the alternate.
func sharedByMigration(a, b hold, cs []Change) bool {
	if a.add.Identity == "" || a.add.Identity != b.add.Identity || (a.add.Migration == "" && b.add.Migration == "") {
		return false
	}
	return slices.ContainsFunc(cs, func(c Change) bool {
		return !c.Deleted && c.Alternate != "" &&
			((c.Owner == a.owner && c.Alternate == b.owner) || (c.Owner == b.owner && c.Alternate == a.owner))
	})
}

// Migrations checks a run's live migrations: ops from the workload,
// changes and bindings from etcd, final what etcd holds at the end.
func Migrations(ops []Op, changes []Change, bindings []BindingChange, final Final, end time.Time) []Finding {
	hs := holds(ops, end)
	var out []Finding
	out = append(out, forwarding(changes, bindings)...)
	out = append(out, finalOwners(hs, final)...)
	slices.SortFunc(out, func(a, b Finding) int {
		return cmp.Or(cmp.Compare(a.Kind, b.Kind), a.Addr.Compare(b.Addr), cmp.Compare(a.Message, b.Message))
	})
	return out
}

// forwarding: at each revision a migration wrote (a binding naming an
// alternate, or the write after one; a record naming an alternate), the
// binding and the identity's records agree on the owner, its node and
// the alternate: one owner forwards, the routes follow its node.
func forwarding(changes []Change, bindings []BindingChange) []Finding {
	recs := changesByAddr(changes)
	byID := map[string][]BindingChange{}
	for _, b := range bindings {
		byID[b.Identity] = append(byID[b.Identity], b)
	}
	for _, bs := range byID {
		slices.SortStableFunc(bs, func(a, b BindingChange) int { return cmp.Compare(a.Rev, b.Rev) })
	}
	var out []Finding
	for id, bs := range byID {
		for i, b := range bs {
			inMigration := b.Alternate != "" || (i > 0 && bs[i-1].Alternate != "")
			if b.Deleted || b.Owner == "" || !inMigration {
				continue
			}
			for _, a := range b.Addrs {
				c, ok := asOf(recs[a], b.Rev)
				if ok && !c.Deleted && c.Owner == b.Owner && c.Node == b.Node && c.Alternate == b.Alternate {
					continue
				}
				out = append(out, Finding{Kind: "forwarding", Addr: a, Message: fmt.Sprintf(
					"at revision %d the binding of %s names %s on %s (alternate %q) and %s's record names %s",
					b.Rev, id, b.Owner, b.Node, b.Alternate, a, recordText(c, ok))})
			}
		}
	}
	for _, c := range changes {
		if c.Deleted || c.Alternate == "" {
			continue
		}
		if c.Alternate == c.Owner {
			out = append(out, Finding{Kind: "forwarding", Addr: c.Addr, Message: fmt.Sprintf(
				"at revision %d %s's record names %s as both its owner and its alternate", c.Rev, c.Addr, c.Owner)})
		}
		b, ok := bindingAsOf(byID[c.Identity], c.Rev)
		if ok && !b.Deleted && b.Owner == c.Owner && b.Node == c.Node && b.Alternate == c.Alternate && slices.Contains(b.Addrs, c.Addr) {
			continue
		}
		out = append(out, Finding{Kind: "forwarding", Addr: c.Addr, Message: fmt.Sprintf(
			"at revision %d %s's record names %s on %s and the alternate %s, and the binding of %q names %s",
			c.Rev, c.Addr, c.Owner, c.Node, c.Alternate, c.Identity, bindingText(b, ok))})
	}
	return out
}

// finalOwners: after the run, every live pod's address still names it
// (lost), each identity with a live pod has exactly one forwarding owner
// among its live pods (owner), and nothing names a pod that holds
// nothing (leak).
func finalOwners(hs []hold, final Final) []Finding {
	live := map[string]hold{} // owner -> a live hold of it
	liveByID := map[string][]string{}
	var out []Finding
	for _, h := range hs {
		if h.hasDel {
			continue
		}
		if _, seen := live[h.owner]; !seen && h.add.Identity != "" {
			liveByID[h.add.Identity] = append(liveByID[h.add.Identity], h.owner)
		}
		live[h.owner] = h
		if r := final.Records[h.addr]; r.Owner != h.owner && r.Alternate != h.owner {
			out = append(out, Finding{Kind: "lost", Addr: h.addr, Message: fmt.Sprintf(
				"%s of %s (ADD answered %s, no DEL) names %s after the run, not it", h.addr, h.owner, stamp(h.from), holderText(r))})
		}
	}
	for addr, r := range final.Records {
		// An owner that holds nothing is Check's leak; an alternate is this.
		if _, ok := live[r.Alternate]; r.Alternate != "" && !ok {
			out = append(out, Finding{Kind: "leak", Addr: addr, Message: fmt.Sprintf(
				"%s's record names %s as its migration's alternate after the run, though that pod holds nothing", addr, r.Alternate)})
		}
	}
	ids := make([]string, 0, len(final.Bindings))
	for id := range final.Bindings {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	for _, id := range ids {
		b := final.Bindings[id]
		for _, who := range []string{b.Owner, b.Alternate} {
			if _, ok := live[who]; who != "" && !ok {
				out = append(out, Finding{Kind: "leak", Addr: first(b.Addrs), Message: fmt.Sprintf(
					"the binding of %s names %s after the run, though that pod holds nothing", id, who)})
			}
		}
	}
	for id, owners := range liveByID {
		b, ok := final.Bindings[id]
		if !ok || b.Owner == "" || !slices.Contains(owners, b.Owner) || live[b.Owner].node != b.Node ||
			(b.Alternate != "" && !slices.Contains(owners, b.Alternate)) {
			out = append(out, Finding{Kind: "owner", Message: fmt.Sprintf(
				"identity %s has live pods %v after the run, and its binding names %s", id, owners, bindingText(b, ok))})
			continue
		}
		for _, a := range b.Addrs {
			if r := final.Records[a]; r.Owner != b.Owner || r.Node != b.Node || r.Alternate != b.Alternate {
				out = append(out, Finding{Kind: "owner", Addr: a, Message: fmt.Sprintf(
					"identity %s's binding names %s on %s (alternate %q) after the run, and %s's record names %s",
					id, b.Owner, b.Node, b.Alternate, a, holderText(r))})
			}
		}
	}
	return out
}

// asOf is the last change of cs (in revision order) at or before rev.
func asOf(cs []Change, rev int64) (Change, bool) {
	i, _ := slices.BinarySearchFunc(cs, rev+1, func(c Change, r int64) int { return cmp.Compare(c.Rev, r) })
	if i == 0 {
		return Change{}, false
	}
	return cs[i-1], true
}

// bindingAsOf is the last change of bs (in revision order) at or before
// rev.
func bindingAsOf(bs []BindingChange, rev int64) (BindingChange, bool) {
	i, _ := slices.BinarySearchFunc(bs, rev+1, func(b BindingChange, r int64) int { return cmp.Compare(b.Rev, r) })
	if i == 0 {
		return BindingChange{}, false
	}
	return bs[i-1], true
}

func recordText(c Change, ok bool) string {
	switch {
	case !ok:
		return "nothing (no record)"
	case c.Deleted:
		return fmt.Sprintf("nothing (deleted at revision %d)", c.Rev)
	}
	return fmt.Sprintf("%s on %s (alternate %q, state %s, revision %d)", c.Owner, c.Node, c.Alternate, c.State, c.Rev)
}

func bindingText(b BindingChange, ok bool) string {
	switch {
	case !ok:
		return "nothing (no binding)"
	case b.Deleted:
		return fmt.Sprintf("nothing (deleted at revision %d)", b.Rev)
	case b.Owner == "":
		return fmt.Sprintf("no pod (kept, revision %d)", b.Rev)
	}
	return fmt.Sprintf("%s on %s (alternate %q, revision %d)", b.Owner, b.Node, b.Alternate, b.Rev)
}

func holderText(r Holder) string {
	if r.Owner == "" && r.Alternate == "" {
		return "nobody (state " + cmp.Or(r.State, "none") + ")"
	}
	return strings.TrimSpace(fmt.Sprintf("%s on %s (alternate %q)", r.Owner, r.Node, r.Alternate))
}

// MigrationCounts are the live migration writes seen in the bindings'
// changes: admissions, cut-overs (the former owner kept as the
// alternate), hand-overs (the owner's DEL: the alternate forwards
// alone) and alternates dropped (the alternate's DEL).
type MigrationCounts struct {
	Admits, CutOvers, HandOvers, Drops int
}

// CountMigrations counts the migration writes in bindings.
func CountMigrations(bindings []BindingChange) MigrationCounts {
	byID := map[string][]BindingChange{}
	for _, b := range bindings {
		byID[b.Identity] = append(byID[b.Identity], b)
	}
	var n MigrationCounts
	for _, bs := range byID {
		slices.SortStableFunc(bs, func(a, b BindingChange) int { return cmp.Compare(a.Rev, b.Rev) })
		for i := 1; i < len(bs); i++ {
			prev, cur := bs[i-1], bs[i]
			switch {
			case cur.Deleted || prev.Deleted:
			case prev.Alternate == "" && cur.Alternate != "" && cur.Owner == prev.Owner:
				n.Admits++
			case prev.Alternate != "" && cur.Owner == prev.Alternate && cur.Alternate == prev.Owner:
				n.CutOvers++
			case prev.Alternate != "" && cur.Owner == prev.Alternate && cur.Alternate == "":
				n.HandOvers++
			case prev.Alternate != "" && cur.Alternate == "" && cur.Owner == prev.Owner:
				n.Drops++
			}
		}
	}
	return n
}
