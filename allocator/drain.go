package allocator

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
)

// Draining CIDRs. An operator retires one CIDR of a pool without stopping
// the pool (kvipamctl pool drain-cidr): while a CIDR drains, no node
// claims a block in it or hands out a new address from it (block walks
// leave it out, and the free addresses of a block a node holds there are
// not handed out), its empty blocks go back to the pool as their pods go,
// and the pool serves on from its other CIDRs. Addresses held there stay
// with their pods. Once nothing is left in it, remove-cidr takes it out.

// ErrCIDRNotInPool is returned for a CIDR an operation names that is not
// one of the pool's (or, to stop a drain, not draining).
var ErrCIDRNotInPool = errors.New("allocator: cidr not in pool")

// Drain marks c, one of p's CIDRs, draining. Draining a CIDR that drains
// already changes nothing. The pool must keep a CIDR of c's family that
// serves (Validate).
func (p *Pool) Drain(c netip.Prefix) error {
	if !slices.Contains(p.CIDRs, c) {
		return fmt.Errorf("drain cidr %s of pool %s: %w: the pool's cidrs are %s", c, p.Name, ErrCIDRNotInPool, prefixList(p.CIDRs))
	}
	if !slices.Contains(p.Draining, c) {
		p.Draining = append(p.Draining, c)
	}
	if err := p.validateDraining(); err != nil {
		return fmt.Errorf("drain cidr %s of pool %s: %w", c, p.Name, err)
	}
	return nil
}

// Undrain lets a draining CIDR of p hand out addresses again.
func (p *Pool) Undrain(c netip.Prefix) error {
	if !slices.Contains(p.Draining, c) {
		return fmt.Errorf("undrain cidr %s of pool %s: %w: draining are %s", c, p.Name, ErrCIDRNotInPool, prefixList(p.Draining))
	}
	p.Draining = slices.DeleteFunc(p.Draining, func(x netip.Prefix) bool { return x == c })
	if len(p.Draining) == 0 {
		p.Draining = nil
	}
	return nil
}

// InDraining reports whether a is in a draining CIDR of p: nothing new
// is handed out there, and a block holding a goes back once empty.
func (p Pool) InDraining(a netip.Addr) bool {
	_, ok := p.DrainingCIDR(a)
	return ok
}

// DrainingCIDR returns the draining CIDR of p that holds a, if any.
func (p Pool) DrainingCIDR(a netip.Addr) (netip.Prefix, bool) {
	a = a.Unmap()
	for _, c := range p.Draining {
		if c.Contains(a) {
			return c, true
		}
	}
	return netip.Prefix{}, false
}

// ServingCIDRsOf returns p's CIDRs of family f that are not draining, in
// pool order: those new blocks are cut from.
func (p Pool) ServingCIDRsOf(f Family) []netip.Prefix {
	return slices.DeleteFunc(p.CIDRsOf(f), func(c netip.Prefix) bool { return slices.Contains(p.Draining, c) })
}

// validateDraining checks that each draining CIDR is one of p's, once,
// and that every family keeps a CIDR that serves: a pool whose IPv4
// CIDRs all drain could give a dual-stack pod no IPv4 address at all,
// which is what disabling the pool is for.
func (p Pool) validateDraining() error {
	for i, c := range p.Draining {
		if !slices.Contains(p.CIDRs, c) {
			return fmt.Errorf("%w: draining cidr %s is not one of the pool's cidrs %s", ErrInvalidPool, c, prefixList(p.CIDRs))
		}
		if slices.Contains(p.Draining[:i], c) {
			return fmt.Errorf("%w: cidr %s is listed as draining twice", ErrInvalidPool, c)
		}
	}
	for _, f := range p.Families() {
		if len(p.ServingCIDRsOf(f)) == 0 {
			return fmt.Errorf("%w: every %s cidr of the pool (%s) would be draining: add a cidr to serve from first (kvipamctl pool add-cidr), or disable the pool",
				ErrInvalidPool, f, prefixList(p.CIDRsOf(f)))
		}
	}
	return nil
}

func prefixList(ps []netip.Prefix) string {
	if len(ps) == 0 {
		return "none"
	}
	s := make([]string, len(ps))
	for i, c := range ps {
		s[i] = c.String()
	}
	return strings.Join(s, ", ")
}
