// Package guestannounce plays a live-migrated guest in tests: it sends,
// from inside a pod's network namespace, the frame a guest announces
// itself with once it runs on the target (a gratuitous ARP, an unsolicited
// neighbor advertisement, or QEMU's RARP), so that it arrives on the
// host veth where the agent watches (package agent/announce).
package guestannounce

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"

	"github.com/containernetworking/plugins/pkg/ns"
	"golang.org/x/sys/unix"

	"github.com/kvipam/kvipam/agent/announce"
)

// Broadcast is the Ethernet broadcast address.
var Broadcast = net.HardwareAddr{0xff, 0xff, 0xff, 0xff, 0xff, 0xff}

// allNodes is ff02::1 and its Ethernet multicast address.
var (
	allNodes    = netip.MustParseAddr("ff02::1")
	allNodesMAC = net.HardwareAddr{0x33, 0x33, 0, 0, 0, 1}
)

// NA flags, in the first byte after the ICMPv6 header.
const (
	NASolicited = 0x40
	NAOverride  = 0x20
)

// Send sends one announcement of kind for addr out of ifName in the
// network namespace at netnsPath ("" the caller's), with mac as the
// sender's hardware address (nil: the interface's own). addr is ignored
// for RARP, which carries none. It enters the namespace for each call,
// which costs milliseconds (a new OS thread); a test that sends many, or
// times the reception, keeps a Sender.
func Send(netnsPath, ifName string, kind announce.Kind, addr netip.Addr, mac net.HardwareAddr) error {
	s, err := NewSender(netnsPath, ifName)
	if err != nil {
		return err
	}
	return errors.Join(s.Send(kind, addr, mac), s.Close())
}

// SendFrame sends a raw Ethernet frame out of ifName in the network
// namespace at netnsPath ("" the caller's), for tests that need a frame
// Frame does not build.
func SendFrame(netnsPath, ifName string, frame []byte) error {
	s, err := NewSender(netnsPath, ifName)
	if err != nil {
		return err
	}
	return errors.Join(s.SendFrame(frame), s.Close())
}

// Sender is an AF_PACKET socket on one interface of a pod's namespace. The
// socket keeps the namespace it was created in, so sending is one system
// call from any goroutine. Safe for concurrent use.
type Sender struct {
	fd      int
	ifindex int
	mac     net.HardwareAddr
}

// NewSender opens a Sender on ifName in the network namespace at netnsPath
// ("" the caller's).
func NewSender(netnsPath, ifName string) (*Sender, error) {
	s := &Sender{fd: -1}
	err := inNetns(netnsPath, func() error {
		ifc, err := net.InterfaceByName(ifName)
		if err != nil {
			return fmt.Errorf("find %s: %w", ifName, err)
		}
		s.ifindex, s.mac = ifc.Index, ifc.HardwareAddr
		// Protocol 0: the socket only sends, it receives nothing.
		s.fd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("open packet socket: %w", err)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return s, nil
}

// Send sends one announcement of kind for addr, with mac as the sender's
// hardware address (nil: the interface's own); see Frame.
func (s *Sender) Send(kind announce.Kind, addr netip.Addr, mac net.HardwareAddr) error {
	if len(mac) == 0 {
		mac = s.mac
	}
	f, err := Frame(kind, addr, mac)
	if err != nil {
		return err
	}
	return s.SendFrame(f)
}

// SendFrame sends a raw Ethernet frame.
func (s *Sender) SendFrame(frame []byte) error {
	if len(frame) < 14 {
		return fmt.Errorf("frame of %d bytes: shorter than an Ethernet header", len(frame))
	}
	sa := &unix.SockaddrLinklayer{Ifindex: s.ifindex, Halen: 6}
	copy(sa.Addr[:], frame[0:6])
	if err := unix.Sendto(s.fd, frame, 0, sa); err != nil {
		return fmt.Errorf("send frame: %w", err)
	}
	return nil
}

// Close closes the socket.
func (s *Sender) Close() error {
	if err := unix.Close(s.fd); err != nil {
		return fmt.Errorf("close packet socket: %w", err)
	}
	return nil
}

// Frame builds the frame Send sends: a gratuitous ARP request
// (sender = target = addr, broadcast), an unsolicited NA (from addr to
// ff02::1, target addr, Override set, target link-layer option mac), or
// QEMU's RARP request (op 3, sender and target hardware mac, no addresses,
// broadcast).
func Frame(kind announce.Kind, addr netip.Addr, mac net.HardwareAddr) ([]byte, error) {
	if len(mac) != 6 {
		return nil, fmt.Errorf("MAC %q is not 6 bytes", mac)
	}
	switch kind {
	case announce.GratuitousARP:
		if !addr.Is4() {
			return nil, fmt.Errorf("gratuitous ARP for %s: not IPv4", addr)
		}
		return ARP(Broadcast, mac, 1, addr, addr), nil
	case announce.NeighborAdvert:
		if !addr.Is6() || addr.Is4In6() {
			return nil, fmt.Errorf("neighbor advertisement for %s: not IPv6", addr)
		}
		return NeighborAdvert(mac, addr, addr, NAOverride), nil
	case announce.RARP:
		return RARPRequest(mac), nil
	}
	return nil, fmt.Errorf("unknown announcement kind %q", kind)
}

func inNetns(path string, fn func() error) error {
	if path == "" {
		return fn()
	}
	return ns.WithNetNSPath(path, func(ns.NetNS) error { return fn() })
}

// ethernet prepends an Ethernet II header.
func ethernet(dst, src net.HardwareAddr, etherType uint16, payload []byte) []byte {
	f := make([]byte, 14, 14+len(payload))
	copy(f[0:6], dst)
	copy(f[6:12], src)
	binary.BigEndian.PutUint16(f[12:14], etherType)
	return append(f, payload...)
}

// ARP is an Ethernet/IPv4 ARP message with operation op (1 request, 2
// reply) from (sha, spa) about tpa, sent to dst. Gratuitous when spa is
// tpa.
func ARP(dst, sha net.HardwareAddr, op uint16, spa, tpa netip.Addr) []byte {
	return ethernet(dst, sha, 0x0806, arpPayload(op, sha, spa, tpa))
}

// RARPRequest is what QEMU's announce_self sends for a guest NIC: a RARP
// request (ethertype 0x8035, op 3) with the sender and target hardware
// addresses mac and no protocol addresses, broadcast.
func RARPRequest(mac net.HardwareAddr) []byte {
	a := arpPayload(3, mac, netip.IPv4Unspecified(), netip.IPv4Unspecified())
	copy(a[18:24], mac)
	return ethernet(Broadcast, mac, 0x8035, a)
}

func arpPayload(op uint16, sha net.HardwareAddr, spa, tpa netip.Addr) []byte {
	a := make([]byte, 28)
	binary.BigEndian.PutUint16(a[0:], 1) // Ethernet
	binary.BigEndian.PutUint16(a[2:], 0x0800)
	a[4], a[5] = 6, 4
	binary.BigEndian.PutUint16(a[6:], op)
	copy(a[8:14], sha)
	s, t := spa.As4(), tpa.As4()
	copy(a[14:18], s[:])
	copy(a[24:28], t[:])
	return a
}

// NeighborAdvert is an ICMPv6 neighbor advertisement from src to ff02::1
// for target with flags (NASolicited, NAOverride) and a target link-layer
// address option mac, hop limit 255, checksum filled in.
func NeighborAdvert(mac net.HardwareAddr, src, target netip.Addr, flags byte) []byte {
	m := make([]byte, 32)
	m[0] = 136
	m[4] = flags
	t := target.As16()
	copy(m[8:24], t[:])
	m[24], m[25] = 2, 1 // target link-layer address, 1 unit of 8 bytes
	copy(m[26:32], mac)

	s, d := src.As16(), allNodes.As16()
	var pseudo []byte
	pseudo = append(pseudo, s[:]...)
	pseudo = append(pseudo, d[:]...)
	pseudo = binary.BigEndian.AppendUint32(pseudo, uint32(len(m)))
	pseudo = append(pseudo, 0, 0, 0, 58)
	binary.BigEndian.PutUint16(m[2:], fold(sum(sum(0, pseudo), m)))

	h := make([]byte, 40, 40+len(m))
	h[0] = 0x60
	binary.BigEndian.PutUint16(h[4:], uint16(len(m)))
	h[6] = 58 // ICMPv6
	h[7] = 255
	copy(h[8:24], s[:])
	copy(h[24:40], d[:])
	return ethernet(allNodesMAC, mac, 0x86dd, append(h, m...))
}

// sum adds b to a ones' complement sum, 16 bits at a time.
func sum(acc uint32, b []byte) uint32 {
	for i := 0; i+1 < len(b); i += 2 {
		acc += uint32(binary.BigEndian.Uint16(b[i:]))
	}
	if len(b)%2 == 1 {
		acc += uint32(b[len(b)-1]) << 8
	}
	return acc
}

func fold(acc uint32) uint16 {
	for acc > 0xffff {
		acc = acc>>16 + acc&0xffff
	}
	return ^uint16(acc)
}
