package allocator

import (
	"errors"
	"fmt"
	"math"
	"math/bits"
	"net/netip"
	"slices"
	"strings"

	"github.com/kvipam/kvipam/internal/foundation/jsonkeep"
)

// Reserved ranges. An operator keeps addresses of a pool back (a gateway,
// a range a DHCP server or a load balancer owns) with a Reservation: the
// allocator never hands a reserved address out by itself, but a static
// request (the "ips" capability or annotation) may take one, which is what
// reserving it is for. Reserving an address that is in use takes nothing
// from its owner; it only keeps it from being handed out again.

// ErrInvalidRange is returned by ParseAddrRange for text that names no
// address, range or CIDR.
var ErrInvalidRange = errors.New("allocator: invalid address range")

// AddrRange is an inclusive range of addresses of one family.
type AddrRange struct {
	First, Last netip.Addr
}

// RangeOf is every address of p, masked, as a range.
func RangeOf(p netip.Prefix) AddrRange {
	return AddrRange{First: p.Masked().Addr(), Last: lastAddr(p)}
}

// ParseAddrRange reads "10.0.0.5", "10.0.0.10-10.0.0.20" or "10.0.0.0/28"
// (every address of the CIDR).
func ParseAddrRange(s string) (AddrRange, error) {
	s = strings.TrimSpace(s)
	if strings.Contains(s, "/") {
		p, err := netip.ParsePrefix(s)
		if err != nil {
			return AddrRange{}, fmt.Errorf("%w: %q: %w", ErrInvalidRange, s, err)
		}
		if p != p.Masked() {
			return AddrRange{}, fmt.Errorf("%w: cidr %s has host bits set, did you mean %s", ErrInvalidRange, p, p.Masked())
		}
		return AddrRange{First: p.Addr(), Last: lastAddr(p)}, nil
	}
	first, last, isRange := strings.Cut(s, "-")
	a, err := netip.ParseAddr(strings.TrimSpace(first))
	if err != nil {
		return AddrRange{}, fmt.Errorf("%w: %q: %w", ErrInvalidRange, s, err)
	}
	r := AddrRange{First: a.Unmap(), Last: a.Unmap()}
	if isRange {
		b, err := netip.ParseAddr(strings.TrimSpace(last))
		if err != nil {
			return AddrRange{}, fmt.Errorf("%w: %q: %w", ErrInvalidRange, s, err)
		}
		r.Last = b.Unmap()
	}
	if err := r.validate(); err != nil {
		return AddrRange{}, err
	}
	return r, nil
}

func (r AddrRange) validate() error {
	switch {
	case !r.First.IsValid() || !r.Last.IsValid():
		return fmt.Errorf("%w: empty", ErrInvalidRange)
	case r.First.Zone() != "" || r.Last.Zone() != "":
		return fmt.Errorf("%w: %s has a zone", ErrInvalidRange, r)
	case FamilyOf(r.First) != FamilyOf(r.Last):
		return fmt.Errorf("%w: %s mixes IPv4 and IPv6", ErrInvalidRange, r)
	case r.Last.Less(r.First):
		return fmt.Errorf("%w: %s ends before it starts", ErrInvalidRange, r)
	}
	return nil
}

// String writes r as ParseAddrRange reads it: one address, a CIDR when r
// is exactly one, or first-last.
func (r AddrRange) String() string {
	if r.First == r.Last {
		return r.First.String()
	}
	for bits := 0; bits <= r.First.BitLen(); bits++ {
		if p := netip.PrefixFrom(r.First, bits); p.Masked().Addr() == r.First && lastAddr(p) == r.Last {
			return p.String()
		}
	}
	return r.First.String() + "-" + r.Last.String()
}

// MarshalText writes r as String does, so a pool read with etcdctl shows
// ranges the way kvipamctl takes them.
func (r AddrRange) MarshalText() ([]byte, error) { return []byte(r.String()), nil }

// UnmarshalText reads what MarshalText wrote.
func (r *AddrRange) UnmarshalText(b []byte) error {
	v, err := ParseAddrRange(string(b))
	if err != nil {
		return err
	}
	*r = v
	return nil
}

// Contains reports whether a is in r.
func (r AddrRange) Contains(a netip.Addr) bool {
	a = a.Unmap()
	return FamilyOf(a) == FamilyOf(r.First) && !a.Less(r.First) && !r.Last.Less(a)
}

// Overlaps reports whether r and o share an address.
func (r AddrRange) Overlaps(o AddrRange) bool {
	return FamilyOf(r.First) == FamilyOf(o.First) && !r.Last.Less(o.First) && !o.Last.Less(r.First)
}

// Size is the number of addresses in r, saturating at math.MaxUint64.
func (r AddrRange) Size() uint64 {
	d := u128From(r.Last).sub(u128From(r.First))
	if d.hi != 0 || d.lo == math.MaxUint64 {
		return math.MaxUint64
	}
	return d.lo + 1
}

// Reservation keeps a range of a pool's addresses from being handed out
// automatically.
type Reservation struct {
	Range  AddrRange `json:"range"`
	Reason string    `json:"reason,omitempty"`
	// Unknown: members this version does not know (jsonkeep).
	jsonkeep.Unknown `json:"-"`
}

// validateReserved checks that each reservation lies inside one CIDR of p
// and that no two overlap (an address counts once).
func (p Pool) validateReserved() error {
	for i, r := range p.Reserved {
		if err := r.Range.validate(); err != nil {
			return fmt.Errorf("%w: reserved[%d]: %w", ErrInvalidPool, i, err)
		}
		c, ok := p.cidrOf(r.Range.First)
		if !ok || !c.Contains(r.Range.Last) {
			return fmt.Errorf("%w: reserved range %s is not inside one cidr of the pool (%s)", ErrInvalidPool, r.Range, joinCIDRs(p.CIDRs))
		}
		for _, o := range p.Reserved[:i] {
			if r.Range.Overlaps(o.Range) {
				return fmt.Errorf("%w: reserved ranges %s and %s overlap", ErrInvalidPool, o.Range, r.Range)
			}
		}
	}
	return nil
}

func joinCIDRs(cs []netip.Prefix) string {
	s := make([]string, len(cs))
	for i, c := range cs {
		s[i] = c.String()
	}
	return strings.Join(s, ", ")
}

// ReservationOf returns the reservation that holds a, if any.
func (p Pool) ReservationOf(a netip.Addr) (Reservation, bool) {
	for _, r := range p.Reserved {
		if r.Range.Contains(a) {
			return r, true
		}
	}
	return Reservation{}, false
}

// ReservedOffsets lists the offsets in block of reserved addresses,
// ascending; network, broadcast and anycast addresses are left out (they
// are never handed out anyway).
func (p Pool) ReservedOffsets(block netip.Prefix) []int {
	var out []int
	first, last := block.Masked().Addr(), lastAddr(block)
	excl := p.Excluded(block)
	for _, r := range p.Reserved {
		if !r.Range.Overlaps(AddrRange{First: first, Last: last}) {
			continue
		}
		lo, hi := r.Range.First, r.Range.Last
		if lo.Less(first) {
			lo = first
		}
		if last.Less(hi) {
			hi = last
		}
		from, _ := Offset(block, lo)
		to, _ := Offset(block, hi)
		for off := from; off <= to; off++ {
			if a, _ := AddrAt(block, off); !slices.Contains(excl, a) {
				out = append(out, off)
			}
		}
	}
	slices.Sort(out)
	return out
}

// Size returns the number of addresses of family f the pool can ever
// hand out (network, broadcast and anycast addresses left out), reserved
// ones included; saturating at math.MaxUint64.
func (p Pool) Size(f Family) uint64 {
	var total uint64
	for _, c := range p.CIDRsOf(f) {
		n := AddrRange{First: c.Masked().Addr(), Last: lastAddr(c)}.Size()
		if n != math.MaxUint64 {
			n -= uint64(len(cidrExcluded(c)))
		}
		var carry uint64
		if total, carry = bits.Add64(total, n, 0); carry != 0 {
			return math.MaxUint64
		}
	}
	return total
}

// ReservedCount returns the number of reserved addresses of family f that
// could otherwise be handed out.
func (p Pool) ReservedCount(f Family) uint64 {
	var total uint64
	for _, r := range p.Reserved {
		if FamilyOf(r.Range.First) != f {
			continue
		}
		n := r.Range.Size()
		if c, ok := p.cidrOf(r.Range.First); ok {
			for _, x := range cidrExcluded(c) {
				if r.Range.Contains(x) && n > 0 {
					n--
				}
			}
		}
		var carry uint64
		if total, carry = bits.Add64(total, n, 0); carry != 0 {
			return math.MaxUint64
		}
	}
	return total
}
