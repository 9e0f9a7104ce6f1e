//go:build linux

package bpf

import (
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"
)

// TestAttachModes: the datapath's mode decides how an endpoint that does
// not say is attached; an endpoint that says overrides it; and on a host
// veth where another tc user already put an ingress qdisc (which excludes
// clsact) the filter joins that qdisc, which detach leaves in place. Each
// way enforces.
func TestAttachModes(t *testing.T) {
	requireDatapath(t)
	h := newHost(t)
	byMode, explicit, busy := h.addPod(t, 1), h.addPod(t, 2), h.addPod(t, 3)
	d := openDatapath(t, pinDir(t))
	require.NoError(t, d.SetAttachMode(AttachTC))
	require.Error(t, d.SetAttachMode("xdp"))

	h.attach(t, d, byMode.ep)
	require.Empty(t, h.tcx(t, byMode.ep.HostIfIndex).programs)
	require.Equal(t, 1, h.tc(t, byMode.ep.HostIfIndex).filters, "mode tc: a clsact filter")

	ep := explicit.ep
	ep.Attach = AttachTCX
	h.attach(t, d, ep)
	require.Len(t, h.tcx(t, ep.HostIfIndex).programs, 1, "the endpoint asked for tcx")
	require.False(t, h.tc(t, ep.HostIfIndex).clsact)

	l, err := h.h.LinkByIndex(busy.ep.HostIfIndex)
	require.NoError(t, err)
	require.NoError(t, h.h.QdiscAdd(&netlink.Ingress{QdiscAttrs: netlink.QdiscAttrs{
		LinkIndex: l.Attrs().Index, Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_INGRESS}}))
	h.attach(t, d, busy.ep)
	filters, err := h.h.FilterList(l, netlink.HANDLE_MIN_INGRESS)
	require.NoError(t, err)
	require.Len(t, filters, 1, "the filter joins the other tc user's ingress qdisc")

	bad := byMode.ep
	bad.Attach = "xdp"
	require.ErrorIs(t, d.Attach(bad), ErrInvalidEndpoint)

	for i, p := range []*pod{byMode, explicit, busy} {
		forged := token(t, "forged")
		p.sendFrame(t, udpFrame(p.hostMAC, p.mac, spoof4, recvV4, recvPort, forged))
		_, ok := h.recv4.got(forged, absentWait)
		require.False(t, ok, "pod %d's spoofed frame passed", i+1)
	}
	for _, p := range []*pod{byMode, explicit, busy} {
		h.detach(t, d, p.ep)
		require.Empty(t, h.tcx(t, p.ep.HostIfIndex).programs)
		require.Zero(t, h.tc(t, p.ep.HostIfIndex).filters)
	}
	qdiscs, err := h.h.QdiscList(l)
	require.NoError(t, err)
	require.True(t, slices.ContainsFunc(qdiscs, func(q netlink.Qdisc) bool { return q.Type() == "ingress" }), "the other tc user's qdisc stays")
	filters, err = h.h.FilterList(l, netlink.HANDLE_MIN_INGRESS)
	require.NoError(t, err)
	require.Empty(t, filters)
}
