//go:build linux

package bpf

import (
	"errors"
	"net/netip"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// TestPortMappingsOverlap: two mappings overlap when family, protocol and
// host port agree and their host addresses are the same or either is
// every address; an endpoint's own overlapping mappings are refused.
func TestPortMappingsOverlap(t *testing.T) {
	pod4, pod6 := netip.MustParseAddr("10.0.0.5"), netip.MustParseAddr("fd00::5")
	host := netip.MustParseAddr("192.0.2.1")
	m := func(proto uint8, hostAddr netip.Addr, port uint16, pod netip.Addr) PortMapping {
		return PortMapping{Protocol: proto, HostAddr: hostAddr, HostPort: port, PodAddr: pod, PodPort: 80}
	}
	tcp, udp := uint8(unix.IPPROTO_TCP), uint8(unix.IPPROTO_UDP)
	for _, c := range []struct {
		a, b PortMapping
		want bool
	}{
		{m(tcp, netip.Addr{}, 8080, pod4), m(tcp, netip.Addr{}, 8080, pod4), true},
		{m(tcp, netip.Addr{}, 8080, pod4), m(tcp, host, 8080, pod4), true},
		{m(tcp, host, 8080, pod4), m(tcp, netip.MustParseAddr("192.0.2.2"), 8080, pod4), false},
		{m(tcp, netip.Addr{}, 8080, pod4), m(udp, netip.Addr{}, 8080, pod4), false},
		{m(tcp, netip.Addr{}, 8080, pod4), m(tcp, netip.Addr{}, 8081, pod4), false},
		{m(tcp, netip.Addr{}, 8080, pod4), m(tcp, netip.Addr{}, 8080, pod6), false},
	} {
		require.Equal(t, c.want, overlaps(c.a, c.b), "%s and %s", c.a, c.b)
		require.Equal(t, c.want, overlaps(c.b, c.a), "%s and %s", c.b, c.a)
	}

	ips := []netip.Addr{pod4, pod6}
	_, err := checkPorts([]PortMapping{m(tcp, netip.Addr{}, 8080, pod4), m(tcp, host, 8080, pod4)}, ips)
	require.True(t, errors.Is(err, ErrInvalidEndpoint), "%v", err)
	_, err = checkPorts([]PortMapping{m(tcp, netip.Addr{}, 8080, netip.MustParseAddr("10.0.0.6"))}, ips)
	require.ErrorIs(t, err, ErrInvalidEndpoint, "a pod address not the endpoint's")
	_, err = checkPorts([]PortMapping{m(tcp, netip.MustParseAddr("fd00::1"), 8080, pod4)}, ips)
	require.ErrorIs(t, err, ErrInvalidEndpoint, "a host address of the other family")
	_, err = checkPorts([]PortMapping{m(47, netip.Addr{}, 8080, pod4)}, ips)
	require.ErrorIs(t, err, ErrInvalidEndpoint, "a protocol other than tcp and udp")
	got, err := checkPorts([]PortMapping{m(tcp, netip.Addr{}, 8080, pod4), m(tcp, netip.Addr{}, 8080, pod6)}, ips)
	require.NoError(t, err)
	require.Len(t, got, 2)
	got, err = checkPorts(nil, ips)
	require.NoError(t, err)
	require.Nil(t, got)
}
