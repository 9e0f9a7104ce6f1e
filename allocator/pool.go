package allocator

import (
	"errors"
	"fmt"
	"math"
	"math/bits"
	"net/netip"
	"slices"
	"time"

	"github.com/kvipam/kvipam/internal/foundation/jsonkeep"
)

var (
	// ErrInvalidPool is returned by Pool.Validate; the message names the
	// pool and the offending value.
	ErrInvalidPool = errors.New("allocator: invalid pool")

	// ErrPoolRenamed is returned by CheckPoolUpdate when the name changes:
	// the name is part of every claim and allocation key.
	ErrPoolRenamed = errors.New("allocator: pool name cannot change")

	// ErrBlockSizeImmutable is returned by CheckPoolUpdate when a block size
	// in use changes: existing claims and allocation keys name blocks of the
	// old size, and a new size would make them overlap new blocks.
	ErrBlockSizeImmutable = errors.New("allocator: block size is immutable")

	// ErrCIDRRemoved is returned by CheckPoolUpdate when a CIDR of the
	// previous pool is missing: claims and allocations inside it would be
	// stranded outside any pool.
	ErrCIDRRemoved = errors.New("allocator: cidr cannot be removed from pool")
)

// Pool is a named set of CIDRs and the per-family block size (prefix length of a block).
//
// A Pool is a plain value stored as JSON in etcd. Check it with Validate
// before use; the other methods answer for an invalid pool without panicking
// but their answers are then meaningless.
type Pool struct {
	// Name identifies the pool in etcd keys and CNI config, hence the
	// restriction to a DNS label.
	Name string `json:"name"`
	// CIDRs are the address ranges blocks are cut from, IPv4 and IPv6 alike.
	CIDRs []netip.Prefix `json:"cidrs"`
	// BlockSizeV4 is the prefix length of an IPv4 block, e.g. 26. It is
	// fixed once the pool exists, since claims name blocks of this size.
	BlockSizeV4 int `json:"blockSizeV4,omitempty"`
	// BlockSizeV6 is the prefix length of an IPv6 block, e.g. 120, fixed
	// like BlockSizeV4.
	BlockSizeV6 int `json:"blockSizeV6,omitempty"`
	// Reserved are ranges never handed out automatically (reserved.go).
	Reserved []Reservation `json:"reserved,omitempty"`
	// Disabled stops the pool handing out new addresses; releases go on.
	// It is how a pool is drained before it is deleted.
	Disabled bool `json:"disabled,omitempty"`
	// Draining are CIDRs of the pool being retired (drain.go): no node
	// hands out a new address or claims a block in them, their empty
	// blocks go back, and the pool serves on from its other CIDRs.
	Draining []netip.Prefix `json:"draining,omitempty"`
	// NodeSelector chooses the nodes that take new blocks and addresses
	// from the pool by their labels (Selector: "rack=r1"); empty: every
	// node. A node it no longer chooses keeps what it holds there.
	NodeSelector string `json:"nodeSelector,omitempty"`
	// ReuseCooldown is how long a released address is not handed out
	// again, unless nothing else in a node's blocks is free: every node
	// holds to it, in its own blocks and in the addresses it borrows
	// (cooldown.go). nil: DefaultReuseCooldown; 0: reuse at once.
	ReuseCooldown *Duration `json:"reuseCooldown,omitempty"`
	// Masquerade says whether a pod of the pool that sends to an address
	// outside every pool has its source translated to its node's
	// (masquerade.go). nil: the routing mode decides (MasqueradeOr).
	Masquerade *bool `json:"masquerade,omitempty"`
	// MaxBlocksPerNode, when above 0, is how many blocks of each family a
	// node claims in the pool at most; beyond them it borrows addresses
	// in other nodes' blocks, or the pool is exhausted for it. It keeps
	// one node from taking a small pool's blocks from the rest. It is
	// schema feature pool-max-blocks (allocator/schema): written only
	// while every live node understands it.
	MaxBlocksPerNode int `json:"maxBlocksPerNode,omitempty"`
	// Rev is the etcd revision the spec was read at (not stored): block
	// claims are fenced by it, so no node claims a block under a spec an
	// operator has since changed (a CIDR removed, the pool deleted).
	Rev int64 `json:"-"`
	// Unknown keeps the members a newer version wrote that this one
	// does not know, so that a rewrite keeps them (jsonkeep).
	jsonkeep.Unknown `json:"-"`
}

const (
	// maxPoolNameLen keeps a pool name a valid DNS label, so it can also
	// name Kubernetes objects and fits etcd keys comfortably.
	maxPoolNameLen = 63

	// maxBlockHostBits bounds a block to 65536 addresses, because a node
	// keeps each block it owns as a bitmap in memory.
	maxBlockHostBits = 16

	// maxBlockIndexBits bounds the blocks of one CIDR to 2^62, so a block
	// index always fits an int64 as well as a uint64 with room to sum a few
	// CIDRs. An IPv6 /64 with /120 blocks (2^56 blocks) is well inside it;
	// a /48 must be split into CIDRs of /50 or longer.
	maxBlockIndexBits = 62
)

// Validate reports the first problem that makes p unusable, wrapping
// ErrInvalidPool. The rules keep every later computation well defined: the
// name appears in etcd keys, blocks must tile each CIDR exactly and be small
// enough to hold as a bitmap, no address may belong to two CIDRs, and no
// CIDR may overlap a special range (special.go).
func (p Pool) Validate() error { return p.validateKeeping(nil) }

// validateKeeping is Validate, except that the CIDRs of kept may overlap
// a special range: they are a stored pool's, written before the rule.
func (p Pool) validateKeeping(kept []netip.Prefix) error {
	if err := p.validate(kept); err != nil {
		return fmt.Errorf("validate pool %q: %w", p.Name, err)
	}
	return nil
}

func (p Pool) validate(kept []netip.Prefix) error {
	if err := validatePoolName(p.Name); err != nil {
		return err
	}
	if _, err := ParseSelector(p.NodeSelector); err != nil {
		return fmt.Errorf("%w: nodeSelector: %w", ErrInvalidPool, err)
	}
	if p.ReuseCooldown != nil {
		if err := ValidateCooldown(time.Duration(*p.ReuseCooldown)); err != nil {
			return err
		}
	}
	if p.MaxBlocksPerNode < 0 {
		return fmt.Errorf("%w: maxBlocksPerNode %d is negative (0: no limit)", ErrInvalidPool, p.MaxBlocksPerNode)
	}
	if len(p.CIDRs) == 0 {
		return fmt.Errorf("%w: no cidrs", ErrInvalidPool)
	}
	mapped := netip.MustParsePrefix("::ffff:0.0.0.0/96")
	for i, c := range p.CIDRs {
		if !c.IsValid() {
			return fmt.Errorf("%w: cidrs[%d] is not a valid prefix", ErrInvalidPool, i)
		}
		if m := c.Masked(); c != m {
			return fmt.Errorf("%w: cidr %s has host bits set, did you mean %s", ErrInvalidPool, c, m)
		}
		if c.Overlaps(mapped) {
			// Addresses from here would be read back as IPv4 by FamilyOf.
			return fmt.Errorf("%w: cidr %s overlaps the IPv4-mapped IPv6 range %s, whose addresses read as IPv4",
				ErrInvalidPool, c, mapped)
		}
		if !slices.Contains(kept, c) {
			if err := CheckSpecialRanges(c); err != nil {
				return err
			}
		}
	}
	for i, a := range p.CIDRs {
		for _, b := range p.CIDRs[i+1:] {
			if a.Overlaps(b) {
				return fmt.Errorf("%w: cidrs %s and %s overlap", ErrInvalidPool, a, b)
			}
		}
	}
	for _, f := range []Family{IPv4, IPv6} {
		if err := p.validateBlockSize(f); err != nil {
			return err
		}
	}
	if err := p.validateReserved(); err != nil {
		return err
	}
	return p.validateDraining()
}

// ValidatePoolName reports whether name can name a pool (a DNS label),
// wrapping ErrInvalidPool.
func ValidatePoolName(name string) error { return validatePoolName(name) }

func validatePoolName(name string) error {
	switch {
	case name == "":
		return fmt.Errorf("%w: name is empty", ErrInvalidPool)
	case len(name) > maxPoolNameLen:
		return fmt.Errorf("%w: name is %d characters long, at most %d allowed", ErrInvalidPool, len(name), maxPoolNameLen)
	case name[0] == '-':
		return fmt.Errorf("%w: name must start with a letter or digit", ErrInvalidPool)
	}
	for _, r := range name {
		if !('a' <= r && r <= 'z' || '0' <= r && r <= '9' || r == '-') {
			return fmt.Errorf("%w: name has character %q, only a-z, 0-9 and '-' are allowed", ErrInvalidPool, r)
		}
	}
	return nil
}

func (p Pool) validateBlockSize(f Family) error {
	field, bs := "blockSizeV4", p.BlockSizeV4
	if f == IPv6 {
		field, bs = "blockSizeV6", p.BlockSizeV6
	}
	cidrs := p.CIDRsOf(f)
	switch {
	case len(cidrs) == 0 && bs != 0:
		return fmt.Errorf("%w: %s is %d but the pool has no %s cidr", ErrInvalidPool, field, bs, f)
	case len(cidrs) == 0:
		return nil
	case bs == 0:
		return fmt.Errorf("%w: %s is not set but the pool has %s cidr %s", ErrInvalidPool, field, f, cidrs[0])
	case bs < 0 || bs > f.bitLen():
		return fmt.Errorf("%w: %s %d is out of range, want %d to %d",
			ErrInvalidPool, field, bs, f.bitLen()-maxBlockHostBits, f.bitLen())
	case f.bitLen()-bs > maxBlockHostBits:
		return fmt.Errorf("%w: %s: block /%d holds 2^%d addresses, at most 2^%d allowed (use /%d or longer)",
			ErrInvalidPool, field, bs, f.bitLen()-bs, maxBlockHostBits, f.bitLen()-maxBlockHostBits)
	}
	for _, c := range cidrs {
		if bs < c.Bits() {
			return fmt.Errorf("%w: block /%d is larger than cidr %s", ErrInvalidPool, bs, c)
		}
		if n := bs - c.Bits(); n > maxBlockIndexBits {
			return fmt.Errorf("%w: cidr %s has 2^%d blocks of /%d, at most 2^%d allowed (split it into cidrs of /%d or longer)",
				ErrInvalidPool, c, n, bs, maxBlockIndexBits, bs-maxBlockIndexBits)
		}
	}
	return nil
}

// CheckPoolUpdate reports whether next may replace prev: same name, block sizes unchanged
// (ErrBlockSizeImmutable), every CIDR of prev still present (removing one could strand claims);
// new CIDRs may be added. next must Validate.
//
// A block size may go from unset to set when next adds the first CIDR of a
// family, since no block of that family can exist yet. Growing a CIDR (a /24
// to its /23) counts as removing the /24; add the other /24 instead.
//
// A CIDR of prev that overlaps a special range (a pool written before
// such ranges were refused) may stay, so that the pool can still be
// disabled or changed; no such CIDR may be added.
func CheckPoolUpdate(prev, next Pool) error {
	if err := next.validateKeeping(prev.CIDRs); err != nil {
		return fmt.Errorf("check pool update: %w", err)
	}
	if prev.Name != next.Name {
		return fmt.Errorf("check pool update %q: %w: new name %q", prev.Name, ErrPoolRenamed, next.Name)
	}
	for _, f := range []Family{IPv4, IPv6} {
		if old, nw := prev.BlockSize(f), next.BlockSize(f); old != 0 && old != nw {
			return fmt.Errorf("check pool update %q: %w: %s block size /%d changed to /%d",
				prev.Name, ErrBlockSizeImmutable, f, old, nw)
		}
	}
	for _, c := range prev.CIDRs {
		if !slices.Contains(next.CIDRs, c) {
			return fmt.Errorf("check pool update %q: %w: cidr %s is missing", prev.Name, ErrCIDRRemoved, c)
		}
	}
	return nil
}

// BlockSize returns the prefix length of p's blocks of family f, or 0 when p
// has no CIDR of that family.
func (p Pool) BlockSize(f Family) int {
	if len(p.CIDRsOf(f)) == 0 {
		return 0
	}
	switch f {
	case IPv4:
		return p.BlockSizeV4
	case IPv6:
		return p.BlockSizeV6
	default:
		return 0
	}
}

// Families returns the families of p's CIDRs, ascending, each once.
func (p Pool) Families() []Family {
	var fs []Family
	for _, f := range []Family{IPv4, IPv6} {
		if len(p.CIDRsOf(f)) > 0 {
			fs = append(fs, f)
		}
	}
	return fs
}

// CIDRsOf returns p's CIDRs of family f, in pool order.
func (p Pool) CIDRsOf(f Family) []netip.Prefix {
	var out []netip.Prefix
	for _, c := range p.CIDRs {
		if prefixFamily(c) == f {
			out = append(out, c)
		}
	}
	return out
}

// Contains reports whether a belongs to one of p's CIDRs. An IPv4-mapped
// address counts as its IPv4 address.
func (p Pool) Contains(a netip.Addr) bool {
	_, ok := p.cidrOf(a.Unmap())
	return ok
}

func (p Pool) cidrOf(a netip.Addr) (netip.Prefix, bool) {
	for _, c := range p.CIDRs {
		if c.IsValid() && c.Contains(a) {
			return c, true
		}
	}
	return netip.Prefix{}, false
}

// BlockFor returns the block of p that holds a, which is how an allocation
// found in etcd or reported by a pod is tied back to its claim.
func (p Pool) BlockFor(a netip.Addr) (netip.Prefix, bool) {
	a = a.Unmap()
	c, ok := p.cidrOf(a)
	if !ok {
		return netip.Prefix{}, false
	}
	bs := p.BlockSize(FamilyOf(a))
	if bs < c.Bits() || bs > a.BitLen() {
		return netip.Prefix{}, false
	}
	b, err := a.Prefix(bs)
	if err != nil {
		return netip.Prefix{}, false
	}
	return b, true
}

// CIDRFor returns the CIDR of p that holds block. ok is false unless block is
// one of p's blocks: masked, of p's block size for its family, inside a CIDR.
func (p Pool) CIDRFor(block netip.Prefix) (netip.Prefix, bool) {
	f := prefixFamily(block)
	if f == 0 || block != block.Masked() || block.Bits() != p.BlockSize(f) {
		return netip.Prefix{}, false
	}
	c, ok := p.cidrOf(block.Addr())
	if !ok || c.Bits() > block.Bits() {
		return netip.Prefix{}, false
	}
	return c, true
}

// BlockCount returns the number of blocks of family f over all of p's CIDRs,
// saturating at math.MaxUint64.
func (p Pool) BlockCount(f Family) uint64 {
	bs := p.BlockSize(f)
	var total uint64
	for _, c := range p.CIDRsOf(f) {
		var carry uint64
		total, carry = bits.Add64(total, BlockCount(c, bs), 0)
		if carry != 0 {
			return math.MaxUint64
		}
	}
	return total
}

// Excluded returns the addresses of block that are never handed out,
// ascending; nil when there are none or block is not one of p's blocks.
//
// Pod addresses are routed as /32 and /128 host routes, so block edges mean
// nothing and only the edges of a pool CIDR are kept back, for hosts that
// treat the CIDR as an attached subnet: in IPv4 CIDRs of /30 or shorter the
// network and broadcast addresses, in IPv6 CIDRs of /126 or shorter the
// subnet-router anycast address (RFC 4291). IPv4 /31 and /32 (RFC 3021) and
// IPv6 /127 and /128 use every address. These addresses can only be in the
// first or last block of a CIDR.
func (p Pool) Excluded(block netip.Prefix) []netip.Addr {
	c, ok := p.CIDRFor(block)
	if !ok {
		return nil
	}
	var out []netip.Addr
	for _, a := range cidrExcluded(c) {
		if block.Contains(a) {
			out = append(out, a)
		}
	}
	return out
}

// cidrExcluded lists the addresses of a pool CIDR never handed out; see
// Pool.Excluded for why.
func cidrExcluded(c netip.Prefix) []netip.Addr {
	first := c.Masked().Addr()
	switch {
	case first.Is4() && c.Bits() <= 30:
		return []netip.Addr{first, lastAddr(c)}
	case first.Is6() && c.Bits() <= 126:
		return []netip.Addr{first}
	default:
		return nil
	}
}

// ErrPoolOverlap reports two pools sharing addresses.
var ErrPoolOverlap = errors.New("allocator: pools overlap")

// CheckDisjoint reports whether p shares any address with another pool.
// Pools must be disjoint: each pool keeps its own allocation keys, so an
// address in two pools could be handed out once in each.
func CheckDisjoint(p Pool, others []Pool) error {
	for _, o := range others {
		for _, a := range p.CIDRs {
			for _, b := range o.CIDRs {
				if a.Overlaps(b) {
					return fmt.Errorf("%w: cidr %s of pool %s overlaps cidr %s of pool %s", ErrPoolOverlap, a, p.Name, b, o.Name)
				}
			}
		}
	}
	return nil
}
