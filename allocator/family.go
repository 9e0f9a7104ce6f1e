package allocator

import (
	"errors"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
)

// ErrInvalidFamily is returned by ParseFamily for an unknown family name.
var ErrInvalidFamily = errors.New("allocator: invalid address family")

// Family is an IP address family.
type Family int

// The values are the IP version numbers, so a Family read from a number in
// config or a log means what it says.
const (
	// IPv4 is the IPv4 family, including IPv4-mapped IPv6 addresses.
	IPv4 Family = 4
	// IPv6 is the IPv6 family.
	IPv6 Family = 6
)

// String returns "ipv4" or "ipv6", the spelling used in config and logs.
func (f Family) String() string {
	switch f {
	case IPv4:
		return "ipv4"
	case IPv6:
		return "ipv6"
	default:
		return "Family(" + strconv.Itoa(int(f)) + ")"
	}
}

// bitLen is the address length of f in bits, 0 for an unknown family.
func (f Family) bitLen() int {
	switch f {
	case IPv4:
		return 32
	case IPv6:
		return 128
	default:
		return 0
	}
}

// FamilyOf returns the family of a. An IPv4-mapped IPv6 address is IPv4: it
// is how an IPv4 address sometimes arrives through IPv6 APIs, and a pool
// never holds mapped addresses. The zero Addr has family 0.
func FamilyOf(a netip.Addr) Family {
	a = a.Unmap()
	switch {
	case a.Is4():
		return IPv4
	case a.Is6():
		return IPv6
	default:
		return 0
	}
}

// prefixFamily is the family of a pool CIDR or block. Unlike FamilyOf it does
// not unmap: a mapped prefix is an IPv6 prefix that Validate rejects.
func prefixFamily(p netip.Prefix) Family {
	switch {
	case !p.IsValid():
		return 0
	case p.Addr().Is4():
		return IPv4
	default:
		return IPv6
	}
}

// ParseFamily reads a family as written in config or on a command line:
// "4", "ipv4", "v4", "6", "ipv6" or "v6", in any case.
func ParseFamily(s string) (Family, error) {
	switch strings.ToLower(s) {
	case "4", "ipv4", "v4":
		return IPv4, nil
	case "6", "ipv6", "v6":
		return IPv6, nil
	default:
		return 0, fmt.Errorf("parse family %q: %w", s, ErrInvalidFamily)
	}
}
