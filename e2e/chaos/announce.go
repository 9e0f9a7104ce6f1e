package chaos

import (
	"fmt"
	"net/netip"
	"slices"
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

// nodes are the distinct announcers of p, sorted.
func (r RouterPoll) nodes(p netip.Prefix) []string {
	ns := slices.Clone(r.Announcers[p])
	slices.Sort(ns)
	return slices.Compact(ns)
}

// DoubleAnnounced finds every prefix that two nodes announced at once for
// bound or longer: a run of polls in a row that each saw two announcers of
// it lasted at least from the run's first poll to its last. With bound 0,
// any poll that saw two is a finding.
func DoubleAnnounced(polls []RouterPoll, bound time.Duration) []Finding {
	polls = slices.Clone(polls)
	slices.SortFunc(polls, func(a, b RouterPoll) int { return a.At.Compare(b.At) })
	type run struct {
		first, last time.Time
		nodes       []string
	}
	open := map[netip.Prefix]*run{}
	var out []Finding
	end := func(p netip.Prefix, r *run) {
		if d := r.last.Sub(r.first); d >= bound {
			out = append(out, Finding{Kind: "double-announced", Addr: p.Addr(), Message: fmt.Sprintf(
				"%s was announced by %v at once from %s to %s (at least %s; the bound is %s)", p, r.nodes, stamp(r.first), stamp(r.last), d, bound)})
		}
	}
	for _, poll := range polls {
		for p := range poll.Announcers {
			ns := poll.nodes(p)
			if len(ns) < 2 {
				continue
			}
			r := open[p]
			if r == nil {
				r = &run{first: poll.At}
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
				end(p, r)
				delete(open, p)
			}
		}
	}
	for p, r := range open {
		end(p, r)
	}
	return out
}
