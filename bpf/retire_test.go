//go:build linux

package bpf

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// TestDisarmFailsClosedThenForget disarms an endpoint, with each attach
// mode: its entries go, its program stays and drops even the pod's own
// frames, Forget refuses while the veth exists, and once the veth is
// deleted Forget leaves no pin, link or entry. A neighbour stays enforced.
func TestDisarmFailsClosedThenForget(t *testing.T) {
	requireDatapath(t)
	for _, mode := range []string{AttachTCX, AttachTC} {
		t.Run(mode, func(t *testing.T) {
			h := newHost(t)
			p1 := h.addPod(t, 1)
			p2 := h.addPod(t, 2)
			dir := pinDir(t)
			d := openDatapath(t, dir)
			p1.ep.Attach, p2.ep.Attach = mode, mode
			h.attach(t, d, p1.ep)
			h.attach(t, d, p2.ep)
			before := h.tcx(t, p1.ep.HostIfIndex)
			tcBefore := h.tc(t, p1.ep.HostIfIndex)

			inNS(t, h.ns, func() error { return d.Disarm(p1.ep) })
			requireNoEntries(t, dir, p1.ep)
			require.Equal(t, before, h.tcx(t, p1.ep.HostIfIndex), "tcx attachment changed by Disarm")
			require.Equal(t, tcBefore, h.tc(t, p1.ep.HostIfIndex), "tc attachment changed by Disarm")
			dropped := counters(t, d, 0).DroppedPackets
			own := token(t, "own-after-disarm")
			p1.sendFrame(t, udpFrame(p1.hostMAC, p1.mac, p1.v4, recvV4, recvPort, own))
			_, ok := h.recv4.got(own, absentWait)
			require.False(t, ok, "a disarmed endpoint's frame got through")
			require.Greater(t, counters(t, d, 0).DroppedPackets, dropped, "drop not counted under ID 0")

			var err error
			inNS(t, h.ns, func() error { err = d.Forget(p1.ep.HostIfIndex); return nil })
			require.ErrorIs(t, err, ErrInterfaceExists)
			require.Equal(t, before, h.tcx(t, p1.ep.HostIfIndex), "Forget detached from a live interface")

			require.NoError(t, h.h.LinkDel(p1.hostIf))
			inNS(t, h.ns, func() error { return d.Forget(p1.ep.HostIfIndex) })
			inNS(t, h.ns, func() error { return d.Forget(p1.ep.HostIfIndex) }) // idempotent
			require.NoFileExists(t, d.linkPin(p1.ep.HostIfIndex))
			for _, id := range before.links {
				require.False(t, linkExists(id), "link %d of the deleted veth still exists", id)
			}

			requireEntries(t, dir, p2.ep)
			p2own := token(t, "p2-own")
			p2.sendFrame(t, udpFrame(p2.hostMAC, p2.mac, p2.v4, recvV4, recvPort, p2own))
			_, ok = h.recv4.got(p2own, arriveWait)
			require.True(t, ok, "the neighbour's own frame was dropped")
		})
	}
}
