package guestannounce

import (
	"encoding/binary"
	"net"
	"net/netip"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/agent/announce"
)

// TestNeighborAdvertChecksum: the ICMPv6 checksum of an NA verifies (the
// ones' complement sum over the pseudo-header and the message is 0xffff),
// and the frame is addressed as RFC 4861 wants an unsolicited NA.
func TestNeighborAdvertChecksum(t *testing.T) {
	mac := net.HardwareAddr{0x02, 0, 0, 0, 0, 1}
	addr := netip.MustParseAddr("fd00:244::11")
	f, err := Frame(announce.NeighborAdvert, addr, mac)
	require.NoError(t, err)
	require.Equal(t, allNodesMAC, net.HardwareAddr(f[0:6]))
	require.Equal(t, uint16(0x86dd), binary.BigEndian.Uint16(f[12:14]))
	ip := f[14:]
	require.Equal(t, byte(255), ip[7], "hop limit")
	icmp := ip[40:]
	var pseudo []byte
	pseudo = append(pseudo, ip[8:40]...)
	pseudo = binary.BigEndian.AppendUint32(pseudo, uint32(len(icmp)))
	pseudo = append(pseudo, 0, 0, 0, 58)
	require.Equal(t, uint16(0), fold(sum(sum(0, pseudo), icmp)), "checksum verifies")
	require.Equal(t, byte(NAOverride), icmp[4], "override, not solicited")
	require.Equal(t, addr.AsSlice(), icmp[8:24])
	require.Equal(t, []byte(mac), icmp[26:32], "target link-layer option")
}

// TestFrameRejects: a kind's frame needs an address of its family and a
// 6-byte MAC.
func TestFrameRejects(t *testing.T) {
	mac := net.HardwareAddr{0x02, 0, 0, 0, 0, 1}
	_, err := Frame(announce.GratuitousARP, netip.MustParseAddr("fd00::1"), mac)
	require.ErrorContains(t, err, "not IPv4")
	_, err = Frame(announce.NeighborAdvert, netip.MustParseAddr("10.0.0.1"), mac)
	require.ErrorContains(t, err, "not IPv6")
	_, err = Frame(announce.RARP, netip.Addr{}, mac[:4])
	require.ErrorContains(t, err, "not 6 bytes")
	_, err = Frame("dhcp", netip.Addr{}, mac)
	require.ErrorContains(t, err, "unknown announcement kind")
}
