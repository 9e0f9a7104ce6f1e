//go:build linux

package bpf

import (
	"encoding/binary"
	"net"
	"net/netip"
)

// Hand-built frames, so that a test controls every address a pod claims.

const (
	etherTypeIPv4 = 0x0800
	etherTypeARP  = 0x0806
	etherTypeIPv6 = 0x86dd
	etherTypeRARP = 0x8035

	protoUDP    = 17
	protoICMPv6 = 58
	protoDstOpt = 60
)

func ethernet(dst, src net.HardwareAddr, etherType uint16, payload []byte) []byte {
	f := make([]byte, 14, 14+len(payload))
	copy(f[0:6], dst)
	copy(f[6:12], src)
	binary.BigEndian.PutUint16(f[12:14], etherType)
	return append(f, payload...)
}

func checksum(sum uint32, b []byte) uint32 {
	for i := 0; i+1 < len(b); i += 2 {
		sum += uint32(binary.BigEndian.Uint16(b[i:]))
	}
	if len(b)%2 == 1 {
		sum += uint32(b[len(b)-1]) << 8
	}
	return sum
}

func fold(sum uint32) uint16 {
	for sum > 0xffff {
		sum = sum>>16 + sum&0xffff
	}
	return ^uint16(sum)
}

func udp(sport, dport uint16, payload []byte) []byte {
	u := make([]byte, 8, 8+len(payload))
	binary.BigEndian.PutUint16(u[0:], sport)
	binary.BigEndian.PutUint16(u[2:], dport)
	binary.BigEndian.PutUint16(u[4:], uint16(8+len(payload)))
	return append(u, payload...)
}

// ipv4 wraps an L4 payload; the UDP checksum stays 0 (allowed for IPv4).
func ipv4(src, dst netip.Addr, proto uint8, l4 []byte) []byte {
	h := make([]byte, 20, 20+len(l4))
	h[0] = 0x45
	binary.BigEndian.PutUint16(h[2:], uint16(20+len(l4)))
	h[8] = 64
	h[9] = proto
	s, d := src.As4(), dst.As4()
	copy(h[12:16], s[:])
	copy(h[16:20], d[:])
	binary.BigEndian.PutUint16(h[10:], fold(checksum(0, h)))
	return append(h, l4...)
}

// ipv6 wraps an L4 payload (after optional extension headers, whose first
// byte the caller leaves for the next header) and fills in the L4 checksum at
// csumOff of the L4 part.
func ipv6(src, dst netip.Addr, hopLimit uint8, proto uint8, ext []byte, l4 []byte, csumOff int) []byte {
	s, d := src.As16(), dst.As16()
	if csumOff >= 0 {
		var pseudo []byte
		pseudo = append(pseudo, s[:]...)
		pseudo = append(pseudo, d[:]...)
		pseudo = binary.BigEndian.AppendUint32(pseudo, uint32(len(l4)))
		pseudo = append(pseudo, 0, 0, 0, proto)
		binary.BigEndian.PutUint16(l4[csumOff:], 0)
		binary.BigEndian.PutUint16(l4[csumOff:], fold(checksum(checksum(0, pseudo), l4)))
	}
	h := make([]byte, 40, 40+len(ext)+len(l4))
	h[0] = 0x60
	binary.BigEndian.PutUint16(h[4:], uint16(len(ext)+len(l4)))
	h[6] = proto
	if len(ext) > 0 {
		h[6] = protoDstOpt
		ext[0] = proto
	}
	h[7] = hopLimit
	copy(h[8:24], s[:])
	copy(h[24:40], d[:])
	return append(append(h, ext...), l4...)
}

// dstOpts is an empty 8-byte destination options header (PadN).
func dstOpts() []byte { return []byte{0, 0, 1, 4, 0, 0, 0, 0} }

func udpFrame(dst, src net.HardwareAddr, from, to netip.Addr, dport uint16, payload string) []byte {
	u := udp(40000, dport, []byte(payload))
	if from.Is4() {
		return ethernet(dst, src, etherTypeIPv4, ipv4(from, to, protoUDP, u))
	}
	return ethernet(dst, src, etherTypeIPv6, ipv6(from, to, 64, protoUDP, nil, u, 6))
}

// udpDstOpts is an IPv6 UDP frame carrying a destination options header.
func udpDstOpts(p *pod, from, to netip.Addr, payload string) []byte {
	u := udp(40000, recvPort, []byte(payload))
	return ethernet(p.hostMAC, p.mac, etherTypeIPv6, ipv6(from, to, 64, protoUDP, dstOpts(), u, 6))
}

// arpFrame is an ARP request from (sha, spa) asking for tpa.
func arpFrame(dst, sha net.HardwareAddr, spa, tpa netip.Addr) []byte {
	return arpOpFrame(dst, sha, 1, spa, tpa)
}

// arpOpFrame is an ARP message with operation op (1 request, 2 reply).
func arpOpFrame(dst, sha net.HardwareAddr, op uint16, spa, tpa netip.Addr) []byte {
	a := make([]byte, 28)
	binary.BigEndian.PutUint16(a[0:], 1) // Ethernet
	binary.BigEndian.PutUint16(a[2:], etherTypeIPv4)
	a[4], a[5] = 6, 4
	binary.BigEndian.PutUint16(a[6:], op)
	copy(a[8:14], sha)
	s, t := spa.As4(), tpa.As4()
	copy(a[14:18], s[:])
	copy(a[24:28], t[:])
	return ethernet(dst, sha, etherTypeARP, a)
}

// rarpFrame is QEMU's announce_self: a RARP request (op 3) with sha and tha
// the guest's MAC, no addresses, broadcast.
func rarpFrame(sha net.HardwareAddr) []byte { return rarpOpFrame(sha, 3) }

// rarpOpFrame is a RARP frame with operation op.
func rarpOpFrame(sha net.HardwareAddr, op uint16) []byte {
	a := make([]byte, 28)
	binary.BigEndian.PutUint16(a[0:], 1)
	binary.BigEndian.PutUint16(a[2:], etherTypeIPv4)
	a[4], a[5] = 6, 4
	binary.BigEndian.PutUint16(a[6:], op)
	copy(a[8:14], sha)
	copy(a[18:24], sha)
	return ethernet(broadcast, sha, etherTypeRARP, a)
}

var broadcast = net.HardwareAddr{0xff, 0xff, 0xff, 0xff, 0xff, 0xff}

// NA flags, in the first byte after the ICMPv6 header.
const (
	naSolicited = 0x40
	naOverride  = 0x20
)

// neighborAdvert is an unsolicited, overriding NA for target with our MAC.
func neighborAdvert(dst, src net.HardwareAddr, from, target netip.Addr, ext []byte) []byte {
	return naFrame(dst, src, from, target, ext, naOverride)
}

// naFrame is an NA to all nodes for target with our MAC and the given flags.
func naFrame(dst, src net.HardwareAddr, from, target netip.Addr, ext []byte, flags byte) []byte {
	allNodes := netip.MustParseAddr("ff02::1")
	m := make([]byte, 32)
	m[0] = 136
	m[4] = flags
	t := target.As16()
	copy(m[8:24], t[:])
	m[24], m[25] = 2, 1 // target link-layer address option
	copy(m[26:32], src)
	return ethernet(dst, src, etherTypeIPv6, ipv6(from, allNodes, 255, protoICMPv6, ext, m, 2))
}

// neighborSolicit is a DAD probe for target, sent from ::.
func neighborSolicit(dst, src net.HardwareAddr, target netip.Addr) []byte {
	m := make([]byte, 24)
	m[0] = 135
	t := target.As16()
	copy(m[8:24], t[:])
	snm := netip.AddrFrom16([16]byte{0xff, 0x02, 11: 1, 12: 0xff, 13: t[13], 14: t[14], 15: t[15]})
	return ethernet(dst, src, etherTypeIPv6, ipv6(netip.IPv6Unspecified(), snm, 255, protoICMPv6, nil, m, 2))
}
