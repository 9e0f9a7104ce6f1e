package inspect

import (
	"fmt"

	"github.com/kvipam/kvipam/allocator/etcdstore"
)

// withAlternatesEnded appends to steps the end of every live migration
// whose second owner (the binding's alternate) runs on node, the node a
// node remove releases, and returns them. Nothing else ends such a
// migration: the forwarding owner's DEL is refused while the alternate's
// node has no live record (no proof that its pod is gone: a node cut off
// from etcd runs its pods on), and the alternate's own DEL will not come
// from a node that is gone. The operator's statement that the node is gone
// is that proof.
//
// Each step rewrites the binding, fenced at its revision, and the records
// that name the alternate, each at its revision, without it, guarded
// (unless forced) by the node's record still absent: a node that comes
// back keeps its pod's place in the migration. A migration whose binding
// or records steps already delete is left to those deletes.
func withAlternatesEnded(s *Snapshot, steps []Step, node string, force bool) []Step {
	touched := make(map[string]bool, len(steps))
	for _, st := range steps {
		touched[st.Key] = true
		for _, k := range st.Also {
			touched[k] = true
		}
	}
	byAddr := s.ipsByAddr()
	for _, b := range s.Bindings {
		alt := b.Alternate
		if alt == nil || alt.Node != node || touched[b.Key] {
			continue
		}
		var rewrite []Guard
		deleted := false
		for _, a := range b.Addrs {
			ip := byAddr[LentKey{b.Pool, a.Unmap()}]
			if ip == nil || ip.Identity != b.Identity || ip.Alternate == nil {
				continue
			}
			deleted = deleted || touched[ip.Key]
			rewrite = append(rewrite, Guard{Key: ip.Key, Rev: ip.Rev})
		}
		if deleted {
			continue
		}
		st := Step{Kind: StepAlternate, Key: b.Key, Rev: b.Rev, Pool: b.Pool, Node: node, Owner: alt.Owner.Key(), Rewrite: rewrite,
			Reason: fmt.Sprintf("live migration of sticky identity %s from %s on %s to its second owner on removed node %s ends",
				b.Identity, b.Owner.Key(), b.Node, node)}
		if !force {
			st.Guards = []Guard{{Key: etcdstore.NodeKey(node)}}
		}
		steps = append(steps, st)
	}
	return steps
}
