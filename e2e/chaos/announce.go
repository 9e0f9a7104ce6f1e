package chaos

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"time"
)

// RouterPoll is one read of a router's BGP tables, stamped with when the
// read began: every prefix with the node of each path it had (a prefix
// two nodes announce has two). A path seen at At was there at some time
// from At to the read's end.
type RouterPoll struct {
	At         time.Time
	Announcers map[netip.Prefix][]string
}

// SplitHosts divides polls into what they saw of blocks and what they
// saw of host prefixes (borrowed addresses, which can move between live
// nodes: a fence of their own bounds those).
func SplitHosts(polls []RouterPoll) (blocks, hosts []RouterPoll) {
	for _, p := range polls {
		b, h := RouterPoll{At: p.At, Announcers: map[netip.Prefix][]string{}}, RouterPoll{At: p.At, Announcers: map[netip.Prefix][]string{}}
		for pfx, ns := range p.Announcers {
			if pfx.Bits() == pfx.Addr().BitLen() {
				h.Announcers[pfx] = ns
			} else {
				b.Announcers[pfx] = ns
			}
		}
		blocks, hosts = append(blocks, b), append(hosts, h)
	}
	return blocks, hosts
}

// nodes are the distinct announcers of p, sorted.
func (r RouterPoll) nodes(p netip.Prefix) []string {
	ns := slices.Clone(r.Announcers[p])
	slices.Sort(ns)
	return slices.Compact(ns)
}

// doubleRun is a run of polls in a row that each saw two or more nodes
// announce prefix: it lasted at least from first to last.
type doubleRun struct {
	prefix      netip.Prefix
	first, last time.Time
	nodes       []string
}

// doubleRuns are every run of polls that saw a prefix with two announcers.
func doubleRuns(polls []RouterPoll) []doubleRun {
	polls = slices.Clone(polls)
	slices.SortFunc(polls, func(a, b RouterPoll) int { return a.At.Compare(b.At) })
	open := map[netip.Prefix]*doubleRun{}
	var out []doubleRun
	for _, poll := range polls {
		for p := range poll.Announcers {
			ns := poll.nodes(p)
			if len(ns) < 2 {
				continue
			}
			r := open[p]
			if r == nil {
				r = &doubleRun{prefix: p, first: poll.At}
				open[p] = r
			}
			r.last = poll.At
			for _, n := range ns {
				if !slices.Contains(r.nodes, n) {
					r.nodes = append(r.nodes, n)
				}
			}
		}
		for p, r := range open {
			if len(poll.nodes(p)) < 2 {
				out = append(out, *r)
				delete(open, p)
			}
		}
	}
	for _, r := range open {
		out = append(out, *r)
	}
	return out
}

// DoubleAnnounced finds every prefix that two nodes announced at once for
// bound or longer: a run of polls in a row that each saw two announcers of
// it lasted at least from the run's first poll to its last. With bound 0,
// any poll that saw two is a finding.
func DoubleAnnounced(polls []RouterPoll, bound time.Duration) []Finding {
	var out []Finding
	for _, r := range doubleRuns(polls) {
		if d := r.last.Sub(r.first); d >= bound {
			out = append(out, Finding{Kind: "double-announced", Addr: r.prefix.Addr(), Message: fmt.Sprintf(
				"%s was announced by %v at once from %s to %s (at least %s; the bound is %s)", r.prefix, r.nodes, stamp(r.first), stamp(r.last), d, bound)})
		}
	}
	slices.SortFunc(out, func(a, b Finding) int { return strings.Compare(a.Message, b.Message) })
	return out
}

// LongestDoubleAnnounced is how long the longest run of polls that saw
// two announcers of one prefix lasted at least, and how many runs there
// were.
func LongestDoubleAnnounced(polls []RouterPoll) (longest time.Duration, runs int) {
	rs := doubleRuns(polls)
	for _, r := range rs {
		longest = max(longest, r.last.Sub(r.first))
	}
	return longest, len(rs)
}

// The kinds of Backing.
const (
	// BackingClaim is a node's claim on a block, on the node's lease.
	BackingClaim = "claim"
	// BackingLent is the home of an address a node borrowed (a host
	// prefix); it has no lease of its own.
	BackingLent = "lent"
	// BackingNode is a node record, on the node's lease.
	BackingNode = "node"
)

// Backing is one change of what entitles a node to announce a prefix: its
// claim on a block, the home of an address it borrowed (with its node
// record, as that home has no lease), or its node record. A deleted claim
// or home names no node: it ends whichever the key held.
type Backing struct {
	Kind    string
	Prefix  netip.Prefix // claims and lent homes
	Node    string
	Deleted bool
	Rev     int64
	Seen    time.Time // when the recorder got it: at or after it happened
}

// span is a time some node held a key, as the recorder saw it.
type span struct {
	node     string
	from, to time.Time
}

// holders is who held each key when, by key.
type holders struct {
	spans map[string][]span
	open  map[string]*span
}

// step applies one change of key: a delete, or a write for another node,
// ends the open span; a write opens one. A key rewritten for the same
// node (a claim moved to a new lease) goes on being held.
func (h *holders) step(key string, b Backing) {
	cur := h.open[key]
	if cur != nil && (b.Deleted || cur.node != b.Node) {
		cur.to = b.Seen
		h.spans[key] = append(h.spans[key], *cur)
		delete(h.open, key)
		cur = nil
	}
	if cur == nil && !b.Deleted {
		h.open[key] = &span{node: b.Node, from: b.Seen, to: time.Unix(1<<40, 0)}
	}
}

// all are the spans, those still open included.
func (h *holders) all() map[string][]span {
	for key, cur := range h.open {
		h.spans[key] = append(h.spans[key], *cur)
	}
	return h.spans
}

// spans turns backing changes into who held each key when: claims and
// lent homes by kind and prefix, node records by node.
func spans(backing []Backing) (byPrefix, byNode map[string][]span) {
	backing = slices.Clone(backing)
	slices.SortStableFunc(backing, func(a, b Backing) int { return int(a.Rev - b.Rev) })
	prefixes := holders{spans: map[string][]span{}, open: map[string]*span{}}
	nodes := holders{spans: map[string][]span{}, open: map[string]*span{}}
	for _, b := range backing {
		if b.Kind == BackingNode {
			nodes.step(b.Node, b)
		} else {
			prefixes.step(b.Kind+" "+b.Prefix.String(), b)
		}
	}
	return prefixes.all(), nodes.all()
}

// near reports whether node held one of ss at some time within bound of at.
func near(ss []span, node string, at time.Time, bound time.Duration) bool {
	return slices.ContainsFunc(ss, func(s span) bool {
		return s.node == node && !s.from.After(at.Add(bound)) && !s.to.Before(at.Add(-bound))
	})
}

// Unbacked finds every announcement a router held without the node's
// claim behind it: each poll's (prefix, node) must be backed, within
// bound of the poll, by the node's claim on the block, or for a host
// prefix (a borrowed address) by the address's home naming the node and
// the node's record (its lease). A run of unbacked polls of one prefix
// and node is one finding.
func Unbacked(polls []RouterPoll, backing []Backing, bound time.Duration) []Finding {
	byPrefix, byNode := spans(backing)
	polls = slices.Clone(polls)
	slices.SortFunc(polls, func(a, b RouterPoll) int { return a.At.Compare(b.At) })
	type run struct{ first, last time.Time }
	open := map[string]*run{}
	var out []Finding
	end := func(key string, r *run) {
		out = append(out, Finding{Kind: "unbacked", Message: fmt.Sprintf("%s from %s to %s, with no claim of that node within %s", key, stamp(r.first), stamp(r.last), bound)})
	}
	for _, poll := range polls {
		for p := range poll.Announcers {
			for _, n := range poll.nodes(p) {
				key := fmt.Sprintf("%s announced by %s", p, n)
				var backed bool
				if p.Bits() == p.Addr().BitLen() {
					backed = near(byPrefix[BackingLent+" "+p.String()], n, poll.At, bound) && near(byNode[n], n, poll.At, bound)
				} else {
					backed = near(byPrefix[BackingClaim+" "+p.String()], n, poll.At, bound)
				}
				r := open[key]
				switch {
				case !backed && r == nil:
					open[key] = &run{first: poll.At, last: poll.At}
				case !backed:
					r.last = poll.At
				case r != nil:
					end(key, r)
					delete(open, key)
				}
			}
		}
	}
	for key, r := range open {
		end(key, r)
	}
	slices.SortFunc(out, func(a, b Finding) int { return strings.Compare(a.Message, b.Message) })
	return out
}
