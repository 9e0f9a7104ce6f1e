package allocator

import (
	"fmt"
	"net/netip"
	"slices"
)

// BlockAlloc is the in-memory free map of one block a node owns. etcd stays
// the source of truth: the agent rebuilds a BlockAlloc from the block's
// allocation keys on start, picks a candidate with Next, and calls Mark only
// once the allocation is written.
//
// A BlockAlloc is not safe for concurrent use; the agent serializes access
// per block.
type BlockAlloc struct {
	block    netip.Prefix
	used     *Bitmap // marked and excluded offsets
	excluded []int   // offsets of Pool.Excluded(block), at most two
	cursor   int     // offset last returned by Next, -1 before the first
	// reserved are the offsets of the pool's reserved ranges: Next skips
	// them, Mark (a static request) may still take one. resFree counts
	// those not marked.
	reserved *Bitmap
	resFree  int
}

// NewBlockAlloc returns an empty free map for block, one of p's blocks. The
// addresses p.Excluded(block) are set for good and never count as free,
// used or capacity.
func NewBlockAlloc(p Pool, block netip.Prefix) (*BlockAlloc, error) {
	if _, ok := p.CIDRFor(block); !ok {
		return nil, fmt.Errorf("new block alloc %s: %w: not a block of pool %q", block, ErrInvalidBlock, p.Name)
	}
	size := BlockSize(block)
	if size > maxBitmapSize {
		return nil, fmt.Errorf("new block alloc %s: %w: %d addresses, at most %d allowed",
			block, ErrInvalidBlock, size, maxBitmapSize)
	}
	b := &BlockAlloc{block: block, used: NewBitmap(size), cursor: -1}
	for _, a := range p.Excluded(block) {
		if off, ok := Offset(block, a); ok {
			b.excluded = append(b.excluded, off)
		}
	}
	b.setExcluded()
	b.SetReserved(p.ReservedOffsets(block))
	return b, nil
}

// SetReserved replaces the reserved offsets (a pool's reservations
// changed). Addresses marked stay marked.
func (b *BlockAlloc) SetReserved(offs []int) {
	b.reserved, b.resFree = nil, 0
	if len(offs) == 0 {
		return
	}
	b.reserved = NewBitmap(b.used.Size())
	for _, off := range offs {
		if b.reserved.Set(off) && !b.used.IsSet(off) {
			b.resFree++
		}
	}
}

func (b *BlockAlloc) isReserved(off int) bool { return b.reserved != nil && b.reserved.IsSet(off) }

func (b *BlockAlloc) setExcluded() {
	for _, off := range b.excluded {
		b.used.Set(off)
	}
}

func (b *BlockAlloc) isExcluded(off int) bool { return slices.Contains(b.excluded, off) }

// Prefix returns the block.
func (b *BlockAlloc) Prefix() netip.Prefix { return b.block }

// Next returns the first free address after the one Next returned last,
// wrapping around the block, without marking it. ok is false when the block
// is full.
//
// Next-fit rather than lowest-free, as host-local does: a container that
// crash-loops releases its address and asks again at once, and handing the
// same address straight back would let stale state about the old container
// (conntrack entries, a peer's ARP or neighbour cache, a late DEL) hit the
// new one. Walking the block first gives that state time to expire.
func (b *BlockAlloc) Next() (netip.Addr, bool) {
	from := b.cursor + 1
	for range b.resFree + 1 {
		off, ok := b.used.NextClear(from)
		if !ok {
			return netip.Addr{}, false
		}
		if !b.isReserved(off) {
			b.cursor = off
			return AddrAt(b.block, off)
		}
		from = off + 1
	}
	return netip.Addr{}, false
}

// Mark records a as used and reports whether that changed anything: false
// when a is outside the block, excluded, or already marked. A false for an
// address the caller believes free is a bookkeeping bug worth reporting.
func (b *BlockAlloc) Mark(a netip.Addr) bool {
	off, ok := Offset(b.block, a)
	if !ok || b.isExcluded(off) {
		return false
	}
	if !b.used.Set(off) {
		return false
	}
	if b.isReserved(off) {
		b.resFree--
	}
	return true
}

// Unmark records a as free again and reports whether that changed anything:
// false when a is outside the block, excluded (those can never be freed), or
// not marked.
func (b *BlockAlloc) Unmark(a netip.Addr) bool {
	off, ok := Offset(b.block, a)
	if !ok || b.isExcluded(off) {
		return false
	}
	if !b.used.Clear(off) {
		return false
	}
	if b.isReserved(off) {
		b.resFree++
	}
	return true
}

// IsUsed reports whether a cannot be handed out: marked or excluded. It is
// false for an address outside the block.
func (b *BlockAlloc) IsUsed(a netip.Addr) bool {
	off, ok := Offset(b.block, a)
	return ok && b.used.IsSet(off)
}

// Free returns the number of addresses Next can still hand out: neither
// marked nor reserved.
func (b *BlockAlloc) Free() int { return b.used.Size() - b.used.Used() - b.resFree }

// Used returns the number of marked addresses, excluded ones not counted.
func (b *BlockAlloc) Used() int { return b.used.Used() - len(b.excluded) }

// Capacity returns the number of addresses the block can ever hand out: its
// size minus the excluded addresses. It can be 0 for a host-sized block at
// the edge of a CIDR.
func (b *BlockAlloc) Capacity() int { return b.used.Size() - len(b.excluded) }

// Reset frees every address again, as when the agent rebuilds the map from
// etcd. Excluded addresses stay used, and the Next cursor is kept so the
// rebuilt map does not hand out recently released addresses first.
func (b *BlockAlloc) Reset() {
	b.used.reset()
	b.setExcluded()
	if b.reserved != nil {
		b.resFree = b.reserved.Used()
		for _, off := range b.excluded {
			if b.reserved.IsSet(off) {
				b.resFree--
			}
		}
	}
}

// ResumeAfter makes the next Next start after a, so a node that rebuilds
// its free map after a restart goes on walking the block where it stopped
// (after its most recent allocation) instead of handing out a just-released
// low address again. An address outside the block is ignored.
func (b *BlockAlloc) ResumeAfter(a netip.Addr) {
	if off, ok := Offset(b.block, a); ok {
		b.cursor = off
	}
}
