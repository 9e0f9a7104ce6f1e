//go:build linux

package bpf

import (
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"
)

// tcmIfindexMagicBlock is TCM_IFINDEX_MAGIC_BLOCK: a tc message whose
// ifindex is this addresses the shared block named by its parent.
const tcmIfindexMagicBlock = -1 // 0xffffffff as the message's int32

// BenchmarkTCHook measures side by side two tc ways to run the program
// on a host veth's ingress, by the netlink operations one endpoint's
// attach and detach cost (the map writes, the same for both, left out):
//
//   - clsact, what the datapath does: a clsact qdisc per endpoint and a
//     BPF filter on it; two rtnl operations to attach, one to detach
//     (deleting the qdisc takes its filter);
//   - shared-block: the filter added once to a tc block that an anchor
//     veth's qdisc holds (ingress_block), and per endpoint a clsact qdisc
//     that joins the block; one rtnl operation to attach, one to detach.
//
// Before the timing, a filter dump of the block must show the filter and
// a qdisc dump of the veth its membership.
func BenchmarkTCHook(b *testing.B) {
	requireDatapath(b)
	h := newHost(b)
	p, anchor := h.addPod(b, 1), h.addPod(b, 2)
	d := openDatapath(b, pinDir(b))
	idx := p.hostIf.Attrs().Index
	filter := func(ifindex int, parent uint32) *netlink.BpfFilter {
		return tcFilter(ifindex, parent, d.objs.KvipamIngress)
	}

	b.Run("clsact", func(b *testing.B) {
		for b.Loop() {
			require.NoError(b, h.h.QdiscAdd(clsact(idx)))
			require.NoError(b, h.h.FilterAdd(filter(idx, netlink.HANDLE_MIN_INGRESS)))
			require.NoError(b, h.h.QdiscDel(clsact(idx)))
		}
	})

	b.Run("shared-block", func(b *testing.B) {
		block := uint32(tcFilterHandle)
		joined := func(ifindex int) *netlink.GenericQdisc {
			q := clsact(ifindex)
			q.IngressBlock = &block
			return q
		}
		require.NoError(b, h.h.QdiscAdd(joined(anchor.hostIf.Attrs().Index)))
		defer func() { require.NoError(b, h.h.QdiscDel(joined(anchor.hostIf.Attrs().Index))) }()
		require.NoError(b, h.h.FilterAdd(filter(tcmIfindexMagicBlock, block)))
		fs, err := h.h.FilterList(&netlink.Device{LinkAttrs: netlink.LinkAttrs{Index: tcmIfindexMagicBlock}}, block)
		require.NoError(b, err)
		require.Len(b, fs, 1, "the block's filter")
		require.NoError(b, h.h.QdiscAdd(joined(idx)))
		qs, err := h.h.QdiscList(p.hostIf)
		require.NoError(b, err)
		member := false
		for _, q := range qs {
			member = member || (q.Type() == "clsact" && q.Attrs().IngressBlock != nil && *q.Attrs().IngressBlock == block)
		}
		require.True(b, member, "the veth's clsact joins the block")
		require.NoError(b, h.h.QdiscDel(joined(idx)))

		for b.Loop() {
			require.NoError(b, h.h.QdiscAdd(joined(idx)))
			require.NoError(b, h.h.QdiscDel(joined(idx)))
		}
	})
}
