package allocator

import "slices"

// MergeConfigured is p as a configuration (kvipamctl pool create, an
// agent's seed) asks for it over the stored spec: what operators manage
// with kvipamctl stays as stored (disabled, draining CIDRs), the node
// selector, reuse cooldown and masquerade stay unless p gives them, and
// p's reserved ranges are added to the stored ones. Every store merges
// by it.
func MergeConfigured(stored, p Pool) Pool {
	p.Unknown = stored.Unknown // what a newer version set stays too
	p.Disabled = stored.Disabled
	p.Draining = slices.Clone(stored.Draining)
	if p.NodeSelector == "" {
		p.NodeSelector = stored.NodeSelector
	}
	if p.ReuseCooldown == nil {
		p.ReuseCooldown = stored.ReuseCooldown
	}
	if p.Masquerade == nil {
		p.Masquerade = stored.Masquerade
	}
	if p.MaxBlocksPerNode == 0 {
		p.MaxBlocksPerNode = stored.MaxBlocksPerNode
	}
	res := slices.Clone(stored.Reserved)
	for _, r := range p.Reserved {
		if !slices.ContainsFunc(res, func(x Reservation) bool { return x.Range == r.Range }) {
			res = append(res, r)
		}
	}
	p.Reserved = res
	return p
}

// SameSpec reports whether two specs of a pool say the same, the
// revision aside, in what this version knows of them (members a newer
// version wrote, jsonkeep.Unknown, are not compared).
func SameSpec(a, b Pool) bool {
	sameRes := func(x, y Reservation) bool { return x.Range == y.Range && x.Reason == y.Reason }
	return a.Name == b.Name && a.BlockSizeV4 == b.BlockSizeV4 && a.BlockSizeV6 == b.BlockSizeV6 &&
		slices.Equal(a.CIDRs, b.CIDRs) && slices.EqualFunc(a.Reserved, b.Reserved, sameRes) && a.Disabled == b.Disabled &&
		slices.Equal(a.Draining, b.Draining) && a.NodeSelector == b.NodeSelector &&
		sameSetting(a.ReuseCooldown, b.ReuseCooldown) && sameSetting(a.Masquerade, b.Masquerade) &&
		a.MaxBlocksPerNode == b.MaxBlocksPerNode
}

// sameSetting reports whether two optional settings are the same: both
// unset (the default), or both set to one value.
func sameSetting[T comparable](a, b *T) bool {
	return (a == nil) == (b == nil) && (a == nil || *a == *b)
}
