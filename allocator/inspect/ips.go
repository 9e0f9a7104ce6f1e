package inspect

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/kvipam/kvipam/allocator/records"
)

// ErrBadFilter is returned for a filter that can match nothing by
// construction, such as an unknown state.
var ErrBadFilter = errors.New("inspect: bad filter")

// IPFilter selects allocations; empty fields match everything.
type IPFilter struct {
	Pool  string
	Node  string
	Owner string // container ID
	State records.State
}

// Validate rejects a state other than reserved or allocated.
func (f IPFilter) Validate() error {
	switch f.State {
	case "", records.StateReserved, records.StateAllocated:
		return nil
	default:
		return fmt.Errorf("%w: state %q, want %q or %q", ErrBadFilter, f.State, records.StateReserved, records.StateAllocated)
	}
}

// Match reports whether ip passes the filter.
func (f IPFilter) Match(ip IP) bool {
	return (f.Pool == "" || ip.Pool == f.Pool) &&
		(f.Node == "" || ip.Node == f.Node) &&
		(f.Owner == "" || ip.ContainerID == f.Owner) &&
		(f.State == "" || ip.State == f.State)
}

// IPs lists the allocations that pass f, in key order (by pool, block,
// address text).
func IPs(s *Snapshot, f IPFilter) ([]IP, error) {
	if err := f.Validate(); err != nil {
		return nil, err
	}
	out := []IP{}
	for _, ip := range s.IPs {
		if f.Match(ip) {
			out = append(out, ip)
		}
	}
	return out, nil
}

// NodeRow is one line of the node list: a node known from its record (it is
// alive) or from the claims, homes and allocations naming it.
type NodeRow struct {
	Node  string `json:"node"`
	Alive bool   `json:"alive"`
	// BootID, Addresses and Version are the live agent's, from its node
	// record: which machine holds the name (a node name has one agent).
	// Labels are its --node-labels, which pools' node selectors choose by.
	BootID    string            `json:"bootID,omitempty"`
	Addresses []string          `json:"addresses,omitempty"`
	Version   string            `json:"version,omitempty"`
	Labels    map[string]string `json:"labels,omitempty"`
	Claims    int               `json:"claims"`
	Homes     int               `json:"homes"`
	IPs       int               `json:"ips"`
}

// Nodes lists every node the snapshot mentions, sorted by name. A node with
// claims, homes or addresses but no record is gone or partitioned away:
// the candidate for kvipamctl node remove.
func Nodes(s *Snapshot) []NodeRow {
	m := map[string]*NodeRow{}
	get := func(n string) *NodeRow {
		r := m[n]
		if r == nil {
			r = &NodeRow{Node: n}
			m[n] = r
		}
		return r
	}
	for n, rec := range s.Nodes {
		r := get(n)
		r.Alive, r.BootID, r.Addresses, r.Version, r.Labels = true, rec.BootID, rec.Addresses, rec.Version, rec.Labels
	}
	for _, c := range s.Claims {
		get(c.Node).Claims++
	}
	for _, h := range s.Homes {
		get(h.Node).Homes++
	}
	for _, ip := range s.IPs {
		get(ip.Node).IPs++
	}
	out := make([]NodeRow, 0, len(m))
	for _, r := range m {
		out = append(out, *r)
	}
	slices.SortFunc(out, func(a, b NodeRow) int { return strings.Compare(a.Node, b.Node) })
	return out
}
