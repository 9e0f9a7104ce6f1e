package inspect

import (
	"errors"
	"fmt"
	"time"
)

// Errors of the evidence PlanNodeRemove, and a release of addresses of a
// node that is not live, require. Compare with errors.Is.
var (
	// ErrNoEvidence refuses a plan without the operator's statement that
	// the node is gone, or with one that names another node.
	ErrNoEvidence = errors.New("inspect: no evidence that the node is gone")
	// ErrEvidenceContradicted refuses a plan when etcd holds a sign that
	// the node was alive after the time the operator last saw it.
	ErrEvidenceContradicted = errors.New("inspect: etcd contradicts the evidence")
)

// EvidenceError is a plan refused for want of evidence that Node is gone
// (it wraps ErrNoEvidence), or for evidence etcd contradicts (it wraps
// ErrEvidenceContradicted). Node is the node the evidence must name, so a
// caller can say what to state.
type EvidenceError struct {
	Node string
	Err  error
}

// Error is the refusal's message.
func (e *EvidenceError) Error() string { return e.Err.Error() }

// Unwrap returns the refusal, which wraps one of the sentinels.
func (e *EvidenceError) Unwrap() error { return e.Err }

// Evidence is an operator's statement that a node is gone for good, which
// PlanNodeRemove requires, and so does a release of addresses whose node
// has no node record.
//
// A missing node record is no proof. A node cut off from etcd for longer
// than its lease TTL loses its node record and its claims exactly as a
// dead node does, while its pods go on using their addresses: freeing its
// blocks then hands those addresses to a second owner (invariant 1). Only
// a person who knows the machine is down (powered off, deleted, fenced)
// can say so, and the statement is kept in the plan for the audit trail.
type Evidence struct {
	// ConfirmGone names the node the operator states is gone. It must be
	// the node being removed, so the statement is made about that node
	// and not carried over from another command line.
	ConfirmGone string `json:"confirmGone"`
	// LastSeen is the last time the node is known to have run. Nothing in
	// etcd may show the node alive after it.
	LastSeen time.Time `json:"lastSeen"`
	// StatedBy is who made the statement (the operator's login name).
	StatedBy string `json:"statedBy,omitempty"`
	// StatedAt is when the statement was made. LastSeen may not be later.
	StatedAt time.Time `json:"statedAt,omitzero"`
}

// sign is one record showing a node alive at a time: what it is, and the
// name of its field holding the time.
type sign struct {
	at          time.Time
	key         string
	what, field string
}

// checkEvidence refuses ev unless it states that node is gone, at a last
// seen time no record of node in s is newer than. A refusal is an
// *EvidenceError.
func checkEvidence(s *Snapshot, node string, ev Evidence) error {
	if err := evidenceFor(s, node, ev); err != nil {
		return &EvidenceError{Node: node, Err: err}
	}
	return nil
}

func evidenceFor(s *Snapshot, node string, ev Evidence) error {
	switch {
	case ev.ConfirmGone == "" || ev.LastSeen.IsZero():
		return fmt.Errorf("%w: a missing node record is not proof, since a node cut off from etcd for longer than its lease TTL "+
			"loses its node record and claims the same way while its pods keep using their addresses; "+
			"state that %s is gone and when it was last seen", ErrNoEvidence, node)
	case ev.ConfirmGone != node:
		return fmt.Errorf("%w: the evidence names node %q, not %q", ErrNoEvidence, ev.ConfirmGone, node)
	case !ev.StatedAt.IsZero() && ev.LastSeen.After(ev.StatedAt):
		return fmt.Errorf("%w: last seen %s is after the statement was made (%s)",
			ErrBadRequest, ev.LastSeen.Format(time.RFC3339), ev.StatedAt.Format(time.RFC3339))
	}
	signs := signsOfLife(s, node)
	var newer []sign
	for _, sg := range signs {
		if sg.at.After(ev.LastSeen) {
			newer = append(newer, sg)
		}
	}
	if len(newer) == 0 {
		return nil
	}
	newest := newer[0]
	for _, sg := range newer[1:] {
		if sg.at.After(newest.at) || sg.at.Equal(newest.at) && sg.key < newest.key {
			newest = sg
		}
	}
	more := ""
	if n := len(newer) - 1; n > 0 {
		more = fmt.Sprintf(", and %d more records", n)
	}
	return fmt.Errorf("%w: node %s was alive after the stated last-seen %s: its %s has %s %s (%s)%s",
		ErrEvidenceContradicted, node, ev.LastSeen.Format(time.RFC3339Nano), newest.what,
		newest.field, newest.at.Format(time.RFC3339Nano), newest.key, more)
}

// signsOfLife lists every record in s that node wrote with a time: its node
// record, its claims and homes, and the allocations that name it.
func signsOfLife(s *Snapshot, node string) []sign {
	var out []sign
	if n, ok := s.Nodes[node]; ok {
		out = append(out, sign{n.StartedAt, n.Key, "node record", "startedAt"})
	}
	for _, c := range s.Claims {
		if c.Node == node {
			out = append(out, sign{c.ClaimedAt, c.Key, "claim of " + c.Block.String(), "claimedAt"})
		}
	}
	for _, h := range s.Homes {
		if h.Node == node {
			out = append(out, sign{h.Since, h.Key, "home of " + h.Block.String(), "since"})
		}
	}
	for _, ip := range s.IPs {
		if ip.Node == node {
			out = append(out, sign{ip.Since, ip.Key, fmt.Sprintf("allocation of %s to %s", ip.Addr, ip.Owner.Key()), "since"})
		}
	}
	return out
}
