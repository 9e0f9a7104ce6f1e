package inspect

import (
	"slices"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/records"
)

// withBindings appends to steps the delete of every sticky binding that
// names an address one of steps deletes from its identity's record (kept
// for the identity, or held by its pod), and returns them.
//
// A binding left behind would name addresses that are gone: the
// identity's next pod would take them over, as new writes into blocks that
// may have no home any more (node remove deletes it), instead of getting
// addresses of its own. Each binding step comes after the address steps
// and is guarded by the binding's revision (a pod that took the identity
// meanwhile keeps it) and by every such address being gone (an address
// step that failed, say because the node came back, leaves the binding).
//
// A binding in the plan's scope (its pod or node is what the plan
// releases) that names a pod holding none of its addresses once the plan
// has run is deleted too: a plan run again after its binding step failed
// finds the addresses gone already, and would otherwise leave the binding
// naming a container that holds nothing. Its guards are its revision and
// each address as the snapshot shows it (absent, or at the revision of
// the record another owner holds).
//
// A binding deleted because steps delete some of its addresses takes the
// rest of the identity's with it (release plans each delete, with the
// plan's reason and fences): a record kept for the identity, or held by
// the pod it names, elsewhere (borrowed into another node's block), would
// otherwise stay kept for an identity whose next pod no longer looks for
// it. A record of a live node is left alone unless the plan is forced.
func withBindings(s *Snapshot, steps []Step, scope func(records.Binding) bool, force bool, release func(*IP) Step) []Step {
	ips := make(map[string]*IP, len(s.IPs))
	for i := range s.IPs {
		ips[s.IPs[i].Key] = &s.IPs[i]
	}
	byAddr := s.ipsByAddr()
	deleted := map[string]bool{}
	for _, st := range steps {
		if st.Kind == StepIP {
			deleted[st.Key] = true
		}
	}
	type identity struct{ pool, name string }
	released := map[identity][]*IP{}
	for _, st := range steps {
		if ip := ips[st.Key]; st.Kind == StepIP && ip != nil && ip.Identity != "" {
			id := identity{ip.Pool, ip.Identity}
			released[id] = append(released[id], ip)
		}
	}
	for _, b := range s.Bindings {
		var guards []Guard
		for _, ip := range released[identity{b.Pool, b.Identity}] {
			if slices.Contains(b.Addrs, ip.Addr.Unmap()) {
				guards = append(guards, Guard{Key: ip.Key})
			}
		}
		if len(guards) > 0 {
			for _, addr := range b.Addrs {
				ip := byAddr[LentKey{b.Pool, addr.Unmap()}]
				if ip == nil || deleted[ip.Key] || ip.Identity != b.Identity || (ip.State != records.StateKept && ip.Owner.Key() != b.Owner.Key()) {
					continue
				}
				if _, live := s.Nodes[ip.Node]; live && !force {
					continue
				}
				steps = append(steps, release(ip))
				deleted[ip.Key] = true
				guards = append(guards, Guard{Key: ip.Key})
			}
		}
		if len(guards) == 0 && !b.Kept() && scope(b.Binding) {
			guards = staleGuards(s, b, byAddr, deleted)
		}
		if len(guards) == 0 {
			continue
		}
		st := Step{Kind: StepBinding, Key: b.Key, Rev: b.Rev, Pool: b.Pool, Node: b.Node, Guards: guards,
			Reason: "binding of sticky identity " + b.Identity + " to released addresses"}
		if !b.Kept() {
			st.Owner = b.Owner.Key()
		}
		steps = append(steps, st)
	}
	return steps
}

// staleGuards returns the guards under which binding b names a pod that
// holds none of its addresses once the deletes of a plan have run, or nil
// if the pod holds one of them still.
func staleGuards(s *Snapshot, b BindingRec, byAddr map[LentKey]*IP, deleted map[string]bool) []Guard {
	p, ok := s.Pools[b.Pool]
	if !ok {
		return nil
	}
	var guards []Guard
	for _, addr := range b.Addrs {
		ip := byAddr[LentKey{b.Pool, addr.Unmap()}]
		switch {
		case ip == nil:
			blk, ok := p.BlockFor(addr)
			if !ok {
				return nil
			}
			guards = append(guards, Guard{Key: etcdstore.IPKey(b.Pool, blk, addr)})
		case deleted[ip.Key]:
			guards = append(guards, Guard{Key: ip.Key})
		case ip.Owner.Key() == b.Owner.Key():
			return nil // the pod still holds it
		default:
			guards = append(guards, Guard{Key: ip.Key, Rev: ip.Rev})
		}
	}
	return guards
}

// ipsByAddr indexes the snapshot's allocations by pool and address.
func (s *Snapshot) ipsByAddr() map[LentKey]*IP {
	out := make(map[LentKey]*IP, len(s.IPs))
	for i := range s.IPs {
		out[LentKey{s.IPs[i].Pool, s.IPs[i].Addr.Unmap()}] = &s.IPs[i]
	}
	return out
}
