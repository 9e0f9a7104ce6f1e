package allocator

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"math/bits"
	"net/netip"
	"strconv"
	"strings"
)

var (
	// ErrInvalidBlock is returned when a block, block size or CIDR given to
	// the block math does not describe a block of that CIDR.
	ErrInvalidBlock = errors.New("allocator: invalid block")

	// ErrBlockIndexOutOfRange is returned by BlockAt for an index past the
	// last block of the CIDR.
	ErrBlockIndexOutOfRange = errors.New("allocator: block index out of range")

	// ErrInvalidBlockName is returned by ParseBlockName for text that
	// BlockName could not have written.
	ErrInvalidBlockName = errors.New("allocator: invalid block name")
)

// u128 is an address as an unsigned 128-bit number, so IPv6 index arithmetic
// stays exact without math/big. IPv4 addresses use the low 32 bits.
type u128 struct{ hi, lo uint64 }

func u128From(a netip.Addr) u128 {
	if a.Is4() {
		b := a.As4()
		return u128{lo: uint64(binary.BigEndian.Uint32(b[:]))}
	}
	b := a.As16()
	return u128{hi: binary.BigEndian.Uint64(b[:8]), lo: binary.BigEndian.Uint64(b[8:])}
}

// addr turns u back into an address of the same family as like.
func (u u128) addr(like netip.Addr) netip.Addr {
	if like.Is4() {
		var b [4]byte
		binary.BigEndian.PutUint32(b[:], uint32(u.lo))
		return netip.AddrFrom4(b)
	}
	var b [16]byte
	binary.BigEndian.PutUint64(b[:8], u.hi)
	binary.BigEndian.PutUint64(b[8:], u.lo)
	return netip.AddrFrom16(b)
}

func (u u128) add(v u128) u128 {
	lo, carry := bits.Add64(u.lo, v.lo, 0)
	hi, _ := bits.Add64(u.hi, v.hi, carry)
	return u128{hi: hi, lo: lo}
}

func (u u128) sub(v u128) u128 {
	lo, borrow := bits.Sub64(u.lo, v.lo, 0)
	hi, _ := bits.Sub64(u.hi, v.hi, borrow)
	return u128{hi: hi, lo: lo}
}

func (u u128) or(v u128) u128 { return u128{hi: u.hi | v.hi, lo: u.lo | v.lo} }

func (u u128) shl(n int) u128 {
	switch {
	case n <= 0:
		return u
	case n >= 128:
		return u128{}
	case n >= 64:
		return u128{hi: u.lo << (n - 64)}
	default:
		return u128{hi: u.hi<<n | u.lo>>(64-n), lo: u.lo << n}
	}
}

func (u u128) shr(n int) u128 {
	switch {
	case n <= 0:
		return u
	case n >= 128:
		return u128{}
	case n >= 64:
		return u128{lo: u.hi >> (n - 64)}
	default:
		return u128{hi: u.hi >> n, lo: u.lo>>n | u.hi<<(64-n)}
	}
}

// hostMask has the low n bits set.
func hostMask(n int) u128 {
	if n >= 128 {
		return u128{hi: math.MaxUint64, lo: math.MaxUint64}
	}
	return u128{lo: 1}.shl(n).sub(u128{lo: 1})
}

// lastAddr is the highest address of p.
func lastAddr(p netip.Prefix) netip.Addr {
	a := p.Masked().Addr()
	return u128From(a).or(hostMask(a.BitLen() - p.Bits())).addr(a)
}

// blockShape checks that blocks of blockBits can tile cidr and returns the
// masked cidr, the host bits of one block and the bits that number the
// blocks. Host bits of cidr are ignored.
func blockShape(cidr netip.Prefix, blockBits int) (base netip.Prefix, hostBits, indexBits int, err error) {
	if !cidr.IsValid() {
		return netip.Prefix{}, 0, 0, fmt.Errorf("%w: cidr %s is not a valid prefix", ErrInvalidBlock, cidr)
	}
	bitLen := cidr.Addr().BitLen()
	if blockBits < cidr.Bits() || blockBits > bitLen {
		return netip.Prefix{}, 0, 0, fmt.Errorf("%w: block size /%d does not fit cidr %s", ErrInvalidBlock, blockBits, cidr)
	}
	return cidr.Masked(), bitLen - blockBits, blockBits - cidr.Bits(), nil
}

// BlockCount returns how many blocks of prefix length blockBits tile cidr,
// saturating at math.MaxUint64 (only reachable with 64 or more index bits,
// which Pool.Validate rejects). It returns 0 when blockBits cannot tile cidr.
func BlockCount(cidr netip.Prefix, blockBits int) uint64 {
	_, _, n, err := blockShape(cidr, blockBits)
	if err != nil {
		return 0
	}
	if n >= 64 {
		return math.MaxUint64
	}
	return 1 << n
}

// BlockAt returns the i-th block (from 0) of prefix length blockBits in cidr.
// Claimers pick blocks by index, so spreading choices over a pool is a
// matter of picking numbers, and the arithmetic is exact for IPv6.
func BlockAt(cidr netip.Prefix, blockBits int, i uint64) (netip.Prefix, error) {
	base, host, n, err := blockShape(cidr, blockBits)
	if err != nil {
		return netip.Prefix{}, fmt.Errorf("block at %d: %w", i, err)
	}
	if n < 64 && i >= 1<<n {
		return netip.Prefix{}, fmt.Errorf("block at %d: %w: cidr %s has %d blocks of /%d",
			i, ErrBlockIndexOutOfRange, cidr, uint64(1)<<n, blockBits)
	}
	// base has zeros in all bits below its prefix length and i < 2^n, so
	// i<<host lands entirely in those zero bits: OR is exact addition.
	a := u128From(base.Addr()).or(u128{lo: i}.shl(host)).addr(base.Addr())
	return netip.PrefixFrom(a, blockBits), nil
}

// BlockIndex is the inverse of BlockAt: the index of block within cidr when
// blocks have prefix length blockBits. ok is false when block is not such a
// block of cidr (wrong size, host bits set, outside cidr) or its index does
// not fit a uint64.
func BlockIndex(cidr netip.Prefix, blockBits int, block netip.Prefix) (uint64, bool) {
	base, host, _, err := blockShape(cidr, blockBits)
	if err != nil || !block.IsValid() || block.Bits() != blockBits || block != block.Masked() ||
		block.Addr().BitLen() != base.Addr().BitLen() || !base.Contains(block.Addr()) {
		return 0, false
	}
	idx := u128From(block.Addr()).sub(u128From(base.Addr())).shr(host)
	if idx.hi != 0 {
		return 0, false
	}
	return idx.lo, true
}

// BlockSize returns the number of addresses in block, saturating at
// math.MaxInt for very short IPv6 prefixes, and 0 for an invalid prefix.
func BlockSize(block netip.Prefix) int {
	if !block.IsValid() {
		return 0
	}
	host := block.Addr().BitLen() - block.Bits()
	if host >= bits.UintSize-1 {
		return math.MaxInt
	}
	return 1 << host
}

// AddrAt returns the address at offset off from the start of block. ok is
// false when off is outside the block.
func AddrAt(block netip.Prefix, off int) (netip.Addr, bool) {
	if off < 0 || off >= BlockSize(block) {
		return netip.Addr{}, false
	}
	base := block.Masked().Addr()
	return u128From(base).add(u128{lo: uint64(off)}).addr(base), true
}

// Offset returns the position of a within block, the index into the block's
// bitmap. An IPv4-mapped IPv6 address counts as its IPv4 address, as in
// FamilyOf. ok is false when a is not in block or carries a zone.
func Offset(block netip.Prefix, a netip.Addr) (int, bool) {
	a = a.Unmap()
	if !block.IsValid() || !block.Contains(a) {
		return 0, false
	}
	d := u128From(a).sub(u128From(block.Masked().Addr()))
	if d.hi != 0 || d.lo > math.MaxInt {
		return 0, false
	}
	return int(d.lo), true
}

// BlockName writes block (its masked form) so it can be one segment of an
// etcd key: ':' and '/' would be read as separators by people and tools, so
// both become '-'. "10.0.1.0/26" is written "10.0.1.0-26" and
// "fd00::100/120" "fd00--100-120". The zero Prefix gives "".
func BlockName(block netip.Prefix) string {
	if !block.IsValid() {
		return ""
	}
	block = block.Masked()
	a := strings.ReplaceAll(block.Addr().String(), ":", "-")
	return a + "-" + strconv.Itoa(block.Bits())
}

// ParseBlockName reads a name written by BlockName. It accepts only the exact
// text BlockName writes (lower-case, shortest IPv6 form, no host bits), so a
// key and its block are in one-to-one correspondence and no two keys can name
// the same block.
func ParseBlockName(s string) (netip.Prefix, error) {
	i := strings.LastIndexByte(s, '-')
	if i < 0 {
		return netip.Prefix{}, fmt.Errorf("parse block name %q: %w: no prefix length", s, ErrInvalidBlockName)
	}
	n, err := strconv.Atoi(s[i+1:])
	if err != nil {
		return netip.Prefix{}, fmt.Errorf("parse block name %q: %w: bad prefix length %q", s, ErrInvalidBlockName, s[i+1:])
	}
	a, err := netip.ParseAddr(strings.ReplaceAll(s[:i], "-", ":"))
	if err != nil {
		return netip.Prefix{}, fmt.Errorf("parse block name %q: %w: bad address", s, ErrInvalidBlockName)
	}
	if a.Zone() != "" {
		return netip.Prefix{}, fmt.Errorf("parse block name %q: %w: address has a zone", s, ErrInvalidBlockName)
	}
	p := netip.PrefixFrom(a, n)
	if !p.IsValid() {
		return netip.Prefix{}, fmt.Errorf("parse block name %q: %w: prefix length %d out of range", s, ErrInvalidBlockName, n)
	}
	if p != p.Masked() {
		return netip.Prefix{}, fmt.Errorf("parse block name %q: %w: host bits set", s, ErrInvalidBlockName)
	}
	if want := BlockName(p); want != s {
		return netip.Prefix{}, fmt.Errorf("parse block name %q: %w: not canonical, want %q", s, ErrInvalidBlockName, want)
	}
	return p, nil
}
