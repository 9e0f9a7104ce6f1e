//go:build linux

package bpf

import (
	"net/netip"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// TestFlowsGoWithTheirMappings checks that a translated flow lives no
// longer than the mapping that translated it: a re-attach that drops a
// mapping drops its flows and keeps the others' (two host ports may serve
// one pod port), a disarm drops all of the endpoint's, and another
// endpoint's flows stay throughout. A restart (Adopt) drops a flow that no
// mapping serves, as an older agent could leave.
func TestFlowsGoWithTheirMappings(t *testing.T) {
	requireDatapath(t)
	h := newHost(t)
	p1, p2, p3 := h.addPod(t, 1), h.addPod(t, 2), h.addPod(t, 3)
	d := openDatapath(t, pinDir(t))

	nodeAddr := netip.MustParseAddr("192.0.2.10")
	tcp8080 := PortMapping{Protocol: unix.IPPROTO_TCP, HostPort: 8080, PodAddr: p1.v4, PodPort: 80}
	tcp8081 := PortMapping{Protocol: unix.IPPROTO_TCP, HostPort: 8081, PodAddr: p1.v4, PodPort: 80}
	udp5353 := PortMapping{Protocol: unix.IPPROTO_UDP, HostPort: 5353, HostAddr: nodeAddr, PodAddr: p1.v4, PodPort: 53}
	tcp6 := PortMapping{Protocol: unix.IPPROTO_TCP, HostPort: 8080, PodAddr: p1.v6, PodPort: 80}
	other := PortMapping{Protocol: unix.IPPROTO_TCP, HostPort: 9090, PodAddr: p2.v4, PodPort: 80}

	ep1 := p1.ep
	ep1.Ports = []PortMapping{tcp8080, tcp8081, udp5353, tcp6}
	ep2 := p2.ep
	ep2.Ports = []PortMapping{other}
	h.attach(t, d, ep1)
	h.attach(t, d, ep2)
	h.attach(t, d, p3.ep) // no mappings

	// The flows the program would record for one client of each mapping.
	peer4, peer6 := netip.MustParseAddr("198.51.100.7"), netip.MustParseAddr("2001:db8::7")
	flow := func(ep Endpoint, m PortMapping, dialed netip.Addr, clientPort uint16) kvipamNatKey {
		peer := peer4
		if m.PodAddr.Is6() {
			peer = peer6
		}
		k := kvipamNatKey{Family: addrKeyOf(m.PodAddr).Family, Proto: m.Protocol, PodPort: htons(m.PodPort), PeerPort: htons(clientPort),
			PodAddr: addrKeyOf(m.PodAddr).Addr, PeerAddr: addrKeyOf(peer).Addr}
		v := kvipamNatInfo{HostAddr: addrKeyOf(dialed).Addr, ClientAddr: k.PeerAddr,
			HostPort: htons(m.HostPort), ClientPort: htons(clientPort), Ifindex: uint32(ep.HostIfIndex)}
		require.NoError(t, d.objs.KvipamNat.Put(k, v))
		return k
	}
	f8080 := flow(ep1, tcp8080, nodeAddr, 40001)
	f8081 := flow(ep1, tcp8081, nodeAddr, 40002)
	f5353 := flow(ep1, udp5353, nodeAddr, 40003)
	f6 := flow(ep1, tcp6, netip.MustParseAddr("2001:db8::10"), 40004)
	fOther := flow(ep2, other, nodeAddr, 40005)
	// An older agent kept the flows of a mapping it dropped.
	stale := flow(ep2, PortMapping{Protocol: unix.IPPROTO_TCP, HostPort: 7070, PodAddr: p2.v4, PodPort: 70}, nodeAddr, 40006)

	flows := func() map[kvipamNatKey]bool {
		out := map[kvipamNatKey]bool{}
		var (
			k kvipamNatKey
			v kvipamNatInfo
		)
		it := d.objs.KvipamNat.Iterate()
		for it.Next(&k, &v) {
			out[k] = true
		}
		require.NoError(t, it.Err())
		return out
	}
	require.Equal(t, map[kvipamNatKey]bool{f8080: true, f8081: true, f5353: true, f6: true, fOther: true, stale: true}, flows())

	// Re-attach without 8081 and the UDP port: their flows go, 8080's
	// (the same pod port as 8081's) and the IPv6 one stay.
	ep1.Ports = []PortMapping{tcp8080, tcp6}
	h.attach(t, d, ep1)
	require.Equal(t, map[kvipamNatKey]bool{f8080: true, f6: true, fOther: true, stale: true}, flows())

	// Disarming an endpoint without mappings touches no flow.
	inNS(t, h.ns, func() error { return d.Disarm(p3.ep) })
	require.Equal(t, map[kvipamNatKey]bool{f8080: true, f6: true, fOther: true, stale: true}, flows())

	inNS(t, h.ns, func() error { return d.Disarm(ep1) })
	require.Equal(t, map[kvipamNatKey]bool{fOther: true, stale: true}, flows())

	// A restart keeps the flow its mapping serves and drops the stale one.
	h.adopt(t, d)
	require.Equal(t, map[kvipamNatKey]bool{fOther: true}, flows())
}
