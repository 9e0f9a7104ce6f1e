//go:build linux

package bpf

import (
	"net/netip"
	"path/filepath"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"
)

// pinnedState is what the pinned maps hold, read from the pins rather than
// through a Datapath.
type pinnedState struct {
	addrs    map[netip.Addr]kvipamAddrInfo
	ifaces   map[uint32]kvipamIfaceInfo
	counters map[uint32]bool
}

func readPinned(tb testing.TB, dir string) pinnedState {
	tb.Helper()
	s := pinnedState{
		addrs:    map[netip.Addr]kvipamAddrInfo{},
		ifaces:   map[uint32]kvipamIfaceInfo{},
		counters: map[uint32]bool{},
	}
	load := func(name string) *ebpf.Map {
		m, err := ebpf.LoadPinnedMap(filepath.Join(dir, name), nil)
		require.NoError(tb, err)
		tb.Cleanup(func() { _ = m.Close() })
		return m
	}
	var (
		key     kvipamAddrKey
		addr    kvipamAddrInfo
		ifindex uint32
		iface   kvipamIfaceInfo
		id      uint32
		percpu  []kvipamCounters
	)
	it := load("kvipam_addrs").Iterate()
	for it.Next(&key, &addr) {
		a, ok := key.addr()
		require.True(tb, ok, "bad family %d", key.Family)
		s.addrs[a] = addr
	}
	require.NoError(tb, it.Err())
	it = load("kvipam_ifaces").Iterate()
	for it.Next(&ifindex, &iface) {
		s.ifaces[ifindex] = iface
	}
	require.NoError(tb, it.Err())
	it = load("kvipam_counters").Iterate()
	for it.Next(&id, &percpu) {
		s.counters[id] = true
	}
	require.NoError(tb, it.Err())
	return s
}

// requireNoEntries asserts the maps hold nothing for ep.
func requireNoEntries(tb testing.TB, dir string, ep Endpoint) {
	tb.Helper()
	s := readPinned(tb, dir)
	for a, info := range s.addrs {
		require.NotEqual(tb, uint32(ep.HostIfIndex), info.Ifindex, "address %s still on ifindex %d", a, ep.HostIfIndex)
	}
	for _, a := range ep.IPs {
		require.NotContains(tb, s.addrs, a)
	}
	require.NotContains(tb, s.ifaces, uint32(ep.HostIfIndex))
	require.NotContains(tb, s.counters, ep.ID)
}

// requireEntries asserts the maps hold exactly ep's addresses for its ifindex.
func requireEntries(tb testing.TB, dir string, ep Endpoint) {
	tb.Helper()
	s := readPinned(tb, dir)
	var got []netip.Addr
	for a, info := range s.addrs {
		if info.Ifindex == uint32(ep.HostIfIndex) {
			require.Equal(tb, ep.ID, info.EndpointId)
			got = append(got, a)
		}
	}
	require.ElementsMatch(tb, ep.IPs, got)
	require.Contains(tb, s.ifaces, uint32(ep.HostIfIndex))
	require.Equal(tb, ep.ID, s.ifaces[uint32(ep.HostIfIndex)].EndpointId)
	require.Contains(tb, s.counters, ep.ID)
}

// tcState is the host veth's clsact state: our filter's program, if any, and
// whether a clsact qdisc exists.
type tcState struct {
	filterProg ebpf.ProgramID
	filters    int
	clsact     bool
}

func (h *host) tc(tb testing.TB, ifindex int) tcState {
	tb.Helper()
	var s tcState
	l, err := h.h.LinkByIndex(ifindex)
	require.NoError(tb, err)
	qdiscs, err := h.h.QdiscList(l)
	require.NoError(tb, err)
	for _, q := range qdiscs {
		if q.Type() == "clsact" {
			s.clsact = true
		}
	}
	if !s.clsact {
		return s
	}
	filters, err := h.h.FilterList(l, netlink.HANDLE_MIN_INGRESS)
	require.NoError(tb, err)
	s.filters = len(filters)
	for _, f := range filters {
		if bf, ok := f.(*netlink.BpfFilter); ok && bf.Name == tcFilterName {
			s.filterProg = ebpf.ProgramID(bf.Id)
		}
	}
	return s
}
