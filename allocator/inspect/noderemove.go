package inspect

import (
	"fmt"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/records"
)

// PlanNodeRemove plans the audited release of a node that is gone
// (invariant 3: "an explicit, audited release may free an orphaned
// block"). Unless forced it refuses a node whose node record exists. It
// always requires ev, the operator's statement that the node is gone
// (ErrNoEvidence without it: a node cut off from etcd looks just like a
// dead one), and refuses it with ErrEvidenceContradicted when a record of
// the node in s is newer than ev.LastSeen. The plan carries ev for the
// audit trail.
//
// For every block the node claims, or whose home it is while no other node
// claims it, the plan deletes in order:
//
//  1. the node's claim, fenced by "node record still absent";
//  2. every allocation under the block, fenced by "claim still absent",
//     "home unchanged" and "the allocation's node record still absent";
//  3. the home, fenced by "claim still absent" and "block empty".
//
// Then, for every sticky identity whose addresses those steps delete (kept
// for it, or its pod's), the identity's other such addresses (in other
// nodes' blocks, written by this node) and its binding, fenced by "binding
// unchanged" and "those addresses gone", so its next pod gets addresses of
// its own and none is left kept for it.
//
// Last, every live migration whose second owner runs on the node ends
// (withAlternatesEnded): its binding and records lose the alternate,
// fenced by the node's record still absent, so the forwarding owner's DEL,
// refused while the alternate's node is away, goes through.
//
// The block is then free for any node to claim. The fences make the plan
// safe against the node coming back at any point: its re-claim changes the
// claim or the home, and the remaining deletes of that block fail instead
// of taking addresses a running pod uses. Steps of one block share a Group,
// so a failed step skips the rest of its block.
//
// Other addresses of the node that sit in other nodes' blocks are left
// alone; Check reports them and PlanReleaseNode releases them. Addresses other
// nodes borrowed from the node's blocks stay too, with the blocks' homes:
// such a block can be claimed again once they are released.
func PlanNodeRemove(s *Snapshot, node string, ev Evidence, force bool) (Plan, error) {
	action := "node remove " + node
	if node == "" {
		return Plan{}, fmt.Errorf("plan node remove: %w: empty node name", ErrBadRequest)
	}
	if err := refuseLive(s, force, node); err != nil {
		return Plan{}, fmt.Errorf("plan %s: %w", action, err)
	}
	if err := checkEvidence(s, node, ev); err != nil {
		return Plan{}, fmt.Errorf("plan %s: %w", action, err)
	}
	p := Plan{Action: action, Revision: s.Revision, Force: force, Evidence: &ev, Steps: []Step{}}
	var others []string // other nodes named by allocations in these blocks
	for _, v := range s.blockViews() {
		steps, nodes := removeBlock(v, node, force)
		p.Steps = append(p.Steps, steps...)
		others = append(others, nodes...)
	}
	if err := refuseLive(s, force, others...); err != nil {
		return Plan{}, fmt.Errorf("plan %s: blocks hold addresses of other nodes: %w", action, err)
	}
	var mine []*IP
	for i := range s.IPs {
		if ip := &s.IPs[i]; ip.Node == node {
			mine = append(mine, ip)
		}
	}
	if err := refuseLiveAlternates(s, force, mine); err != nil {
		return Plan{}, fmt.Errorf("plan %s: %w", action, err)
	}
	p.Steps = withBindings(s, p.Steps, func(b records.Binding) bool { return b.Node == node }, force, func(ip *IP) Step {
		return ipStep(ip, "address of sticky identity "+ip.Identity+", whose binding node remove "+node+" releases", etcdstore.EndNodeRemove, force)
	})
	p.Steps = withAlternatesEnded(s, p.Steps, node, force)
	return p, nil
}

// removeBlock plans the steps that free one block of node, and returns the
// other nodes whose addresses they delete.
func removeBlock(v *blockView, node string, force bool) ([]Step, []string) {
	mineClaim := v.claim != nil && v.claim.Node == node
	mineHome := v.home != nil && v.home.Node == node
	if !mineClaim && (!mineHome || v.claim != nil) {
		return nil, nil
	}
	group := v.Pool + "/" + allocator.BlockName(v.Block)
	base := Step{Pool: v.Pool, Block: v.Block, Node: node, Group: group}
	var nodeGuard []Guard
	if !force {
		nodeGuard = []Guard{{Key: etcdstore.NodeKey(node)}}
	}
	var steps []Step
	if mineClaim {
		st := base
		st.Kind, st.Key, st.Rev, st.Guards = StepClaim, v.claim.Key, v.claim.Rev, nodeGuard
		st.Reason = "claim of removed node " + node
		steps = append(steps, st)
		if v.home != nil && !mineHome {
			// Another node's home: after the claim is gone the block is
			// that node's to re-claim, not ours to empty.
			return steps, nil
		}
	}
	// The block stays as the plan saw it: unclaimed, same home.
	fence := []Guard{{Key: etcdstore.ClaimKey(v.Pool, v.Block)}}
	if v.home != nil {
		fence = append(fence, Guard{Key: v.home.Key, Rev: v.home.Rev})
	}
	var others []string
	lent := 0
	for _, ip := range v.ips {
		if ip.Borrowed && ip.Node != node {
			// Another node's pod borrowed it: it stays, and so does the
			// home; the block is free to claim once it is released.
			lent++
			continue
		}
		reason := "address in block of removed node " + node
		guards := append([]Guard{}, fence...)
		if ip.Node != node {
			reason += " (record names node " + ip.Node + ")"
			others = append(others, ip.Node)
		}
		steps = append(steps, withGroup(ipStep(ip, reason, etcdstore.EndNodeRemove, force, guards...), group))
	}
	for _, b := range v.bad {
		st := base
		st.Kind, st.Key, st.Rev = StepIP, b.Key, b.Rev
		st.Reason = "undecodable allocation in block of removed node " + node
		st.Guards = append(append([]Guard{}, fence...), nodeGuard...)
		steps = append(steps, st)
	}
	if mineHome && lent == 0 {
		st := base
		st.Kind, st.Key, st.Rev = StepHome, v.home.Key, v.home.Rev
		st.Reason = "home of removed node " + node
		st.Guards = []Guard{fence[0], {Key: etcdstore.BlockIPsPrefix(v.Pool, v.Block), Prefix: true}}
		steps = append(steps, st)
	}
	return steps, others
}

func withGroup(st Step, group string) Step {
	st.Group = group
	return st
}
