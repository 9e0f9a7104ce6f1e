package allocator

import "fmt"

// Egress masquerade. A pod address is routable only where something
// routes its pool: with host-gw or VXLAN nothing outside the cluster
// does, and a reply to a pod could never come back unless the node
// translates the pod's source to its own address on the way out. With
// BGP the fabric routes the pool and the pod keeps its address. Every
// node must do the same for a pool (a pod's traffic must not change
// when it moves), so it is the pool's setting, in etcd; unset, each
// node decides from its routing mode, which every node of a cluster
// shares.

// MasqueradeOr says whether p's pods are masqueraded: p's setting, or
// def (the routing mode's default) when p sets none.
func (p Pool) MasqueradeOr(def bool) bool {
	if p.Masquerade == nil {
		return def
	}
	return *p.Masquerade
}

// MasqueradeSetting is p's masquerade setting as an operator writes it:
// "on", "off" or "default".
func (p Pool) MasqueradeSetting() string {
	switch {
	case p.Masquerade == nil:
		return "default"
	case *p.Masquerade:
		return "on"
	}
	return "off"
}

// ParseMasquerade reads a masquerade setting as an operator writes it:
// on, off, or default (nil: the routing mode decides).
func ParseMasquerade(s string) (*bool, error) {
	switch s {
	case "on", "true":
		v := true
		return &v, nil
	case "off", "false":
		v := false
		return &v, nil
	case "default":
		return nil, nil
	}
	return nil, fmt.Errorf("%w: masquerade %q: want on, off or default", ErrInvalidPool, s)
}
