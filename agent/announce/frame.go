package announce

import (
	"encoding/binary"
	"net"
	"net/netip"
)

// Frame layout, as the packet watcher's filter (filter.go) and parseFrame
// read it: Ethernet II without a VLAN tag.
const (
	ethHeader = 14
	arpLen    = 28 // Ethernet/IPv4 ARP or RARP payload
	ipv6Len   = 40
	naMinLen  = 24 // ICMPv6 header, flags, target

	etherTypeARP  = 0x0806
	etherTypeRARP = 0x8035
	etherTypeIPv6 = 0x86dd

	protoICMPv6      = 58
	icmpv6NA         = 136
	naFlagSolicited  = 0x40
	arpOpRequest     = 1
	arpOpReply       = 2
	rarpOpRequest    = 3
	rarpOpReply      = 4
	arpHardwareEther = 1
)

// parseFrame reports the announcement an Ethernet frame makes, if any: a
// gratuitous ARP, an unsolicited neighbor advertisement (directly after
// the IPv6 header), or a RARP request or reply. It applies no address
// filter.
func parseFrame(f []byte) (kind Kind, addr netip.Addr, mac net.HardwareAddr, ok bool) {
	if len(f) < ethHeader {
		return "", netip.Addr{}, nil, false
	}
	switch binary.BigEndian.Uint16(f[12:14]) {
	case etherTypeARP:
		return parseARP(f[ethHeader:])
	case etherTypeRARP:
		return parseRARP(f[ethHeader:])
	case etherTypeIPv6:
		return parseNA(f)
	}
	return "", netip.Addr{}, nil, false
}

// arpHeader checks an Ethernet/IPv4 ARP header and returns its operation.
func arpHeader(a []byte) (op uint16, ok bool) {
	if len(a) < arpLen ||
		binary.BigEndian.Uint16(a[0:2]) != arpHardwareEther ||
		binary.BigEndian.Uint16(a[2:4]) != 0x0800 || a[4] != 6 || a[5] != 4 {
		return 0, false
	}
	return binary.BigEndian.Uint16(a[6:8]), true
}

// parseARP: an ARP request or reply whose sender protocol address is its
// target's, and not 0.0.0.0 (that is an RFC 5227 probe, which announces
// nothing).
func parseARP(a []byte) (Kind, netip.Addr, net.HardwareAddr, bool) {
	op, ok := arpHeader(a)
	if !ok || (op != arpOpRequest && op != arpOpReply) {
		return "", netip.Addr{}, nil, false
	}
	spa := netip.AddrFrom4([4]byte(a[14:18]))
	tpa := netip.AddrFrom4([4]byte(a[24:28]))
	if spa != tpa || spa.IsUnspecified() {
		return "", netip.Addr{}, nil, false
	}
	return GratuitousARP, spa, net.HardwareAddr(a[8:14]), true
}

// parseRARP: a RARP request or reply; its sender hardware address.
func parseRARP(a []byte) (Kind, netip.Addr, net.HardwareAddr, bool) {
	op, ok := arpHeader(a)
	if !ok || (op != rarpOpRequest && op != rarpOpReply) {
		return "", netip.Addr{}, nil, false
	}
	return RARP, netip.Addr{}, net.HardwareAddr(a[8:14]), true
}

// parseNA: an ICMPv6 neighbor advertisement with the S flag clear; its
// target, and the frame's Ethernet source.
func parseNA(f []byte) (Kind, netip.Addr, net.HardwareAddr, bool) {
	ip := f[ethHeader:]
	if len(ip) < ipv6Len+naMinLen || ip[0]>>4 != 6 || ip[6] != protoICMPv6 {
		return "", netip.Addr{}, nil, false
	}
	icmp := ip[ipv6Len:]
	if icmp[0] != icmpv6NA || icmp[1] != 0 || icmp[4]&naFlagSolicited != 0 {
		return "", netip.Addr{}, nil, false
	}
	return NeighborAdvert, netip.AddrFrom16([16]byte(icmp[8:24])), net.HardwareAddr(f[6:12]), true
}
