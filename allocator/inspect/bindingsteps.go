package inspect

import "slices"

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
func withBindings(s *Snapshot, steps []Step) []Step {
	ips := make(map[string]*IP, len(s.IPs))
	for i := range s.IPs {
		ips[s.IPs[i].Key] = &s.IPs[i]
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
