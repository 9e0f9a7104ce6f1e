package planner

import (
	"fmt"
	"time"

	"github.com/kvipam/kvipam/allocator/records"
)

// RefusedError is the error of a request for a refused pool, naming why.
func RefusedError(ps *Pool) error {
	return fmt.Errorf("%w: pool %s is refused and hands out no addresses: %w (fix or delete it: kvipamctl pool remove-cidr, pool delete)",
		records.ErrPoolDisabled, ps.spec.Name, ps.refused)
}

// notSelected is the error of a request for a pool that does not choose
// this node, naming the pool, its selector and the node's labels.
func (n *Node) notSelected(ps *Pool) error {
	return fmt.Errorf("%w: pool %s serves only nodes matching %q; node %s (labels %s) takes no new address there (kvipamctl pool show %s lists the nodes it serves)",
		records.ErrNodeNotSelected, ps.spec.Name, ps.spec.NodeSelector, n.name, n.labelText(), ps.spec.Name)
}

// takeoverNotSelected is the error of a sticky identity's pod on a node
// ps's selector leaves out: b's addresses stay where they are.
func (n *Node) takeoverNotSelected(ps *Pool, b records.Binding) error {
	where := fmt.Sprintf("held by its pod %s/%s on node %s", b.Owner.Namespace, b.Owner.Pod, b.Node)
	if b.Kept() {
		where = "kept for it until " + b.Since.Add(b.Window()).UTC().Format(time.RFC3339)
	}
	return fmt.Errorf("%w: sticky identity %s has %v in pool %s (%s), which serves only nodes matching %q; node %s (labels %s) cannot take them over: run the identity's pods on nodes the selector chooses (kvipamctl pool show %s lists them)",
		records.ErrNodeNotSelected, b.Identity, b.Addrs, ps.spec.Name, where, ps.spec.NodeSelector, n.name, n.labelText(), ps.spec.Name)
}

// NotSelected refuses this node b's addresses in ps when the pool's
// selector leaves it out, as a takeover is refused: a live migration's
// target is not admitted there (its addresses would route to a node the
// pool does not serve). Nil when the node is selected.
func (n *Node) NotSelected(ps *Pool, b records.Binding) error {
	if n.selected(ps) {
		return nil
	}
	return n.takeoverNotSelected(ps, b)
}
