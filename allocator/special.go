package allocator

import (
	"fmt"
	"net/netip"
	"slices"
)

// Special ranges. Some addresses can never be a pod's, whatever the
// routing: the kernel keeps them for itself (loopback), routers do not
// forward them (link-local), they name no single host (multicast,
// broadcast, "this network"), or every pod already uses one of them as
// its gateway (169.254.1.1 and fe80::ecee:eeff:feee:eeee, agent/api's
// GatewayV4 and GatewayV6). A pool overlapping one is invalid: a pod
// handed such an address fails its ADD or has no network. The rule is
// here, in Pool.Validate, so that every entry point applies it: kvipamctl
// pool create and add-cidr, an agent's seed pools, and the pools an agent
// reads from etcd (a pool written before the rule is refused there).

// SpecialRange is an address range no pool may overlap.
type SpecialRange struct {
	Prefix netip.Prefix
	// Name is what the range is; Why is what goes wrong for a pod given
	// an address from it.
	Name, Why string
}

// specialRanges, IPv4 then IPv6, each ascending.
var specialRanges = []SpecialRange{
	{netip.MustParsePrefix("0.0.0.0/8"), `"this network" (RFC 1122)`,
		"not a destination address: 0.0.0.0 means any address, and no host may have an address from it"},
	{netip.MustParsePrefix("127.0.0.0/8"), "IPv4 loopback (RFC 1122)",
		"every host, the pod's node included, keeps it on its own loopback device: packets to it never leave the host"},
	{netip.MustParsePrefix("169.254.0.0/16"), "IPv4 link-local (RFC 3927)",
		"routers do not forward it, and it holds 169.254.1.1, every pod's IPv4 gateway: a pod given that address fails its ADD"},
	{netip.MustParsePrefix("224.0.0.0/4"), "IPv4 multicast (RFC 5771)",
		"a multicast address names a group, not a host; it cannot be an interface's unicast address"},
	{netip.MustParsePrefix("255.255.255.255/32"), "the IPv4 limited broadcast address (RFC 919)",
		"packets to it go to every host on the link and are never forwarded"},
	{netip.MustParsePrefix("::1/128"), "IPv6 loopback (RFC 4291)",
		"every host keeps it on its own loopback device: packets to it never leave the host"},
	{netip.MustParsePrefix("fe80::/10"), "IPv6 link-local (RFC 4291)",
		"routers do not forward it, every interface already has an address from it, and it holds fe80::ecee:eeff:feee:eeee, every pod's IPv6 gateway"},
	{netip.MustParsePrefix("ff00::/8"), "IPv6 multicast (RFC 4291)",
		"a multicast address names a group, not a host; it cannot be an interface's unicast address"},
}

// SpecialRanges returns the ranges no pool may overlap, IPv4 first.
func SpecialRanges() []SpecialRange { return slices.Clone(specialRanges) }

// SpecialRangeError reports a pool CIDR that overlaps a SpecialRange. It
// comes wrapped with ErrInvalidPool.
type SpecialRangeError struct {
	CIDR  netip.Prefix
	Range SpecialRange
}

func (e *SpecialRangeError) Error() string {
	return fmt.Sprintf("cidr %s overlaps %s, %s: %s", e.CIDR, e.Range.Prefix, e.Range.Name, e.Range.Why)
}

// CheckSpecialRanges reports the first special range c overlaps, as a
// *SpecialRangeError wrapped with ErrInvalidPool; nil when c overlaps none.
func CheckSpecialRanges(c netip.Prefix) error {
	for _, r := range specialRanges {
		if c.Overlaps(r.Prefix) {
			return fmt.Errorf("%w: %w", ErrInvalidPool, &SpecialRangeError{CIDR: c, Range: r})
		}
	}
	return nil
}
