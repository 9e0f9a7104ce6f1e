package e2e

import (
	"context"
	"encoding/binary"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/kvipam/kvipam/bpf"
	"github.com/kvipam/kvipam/cni"
)

func requireBPF(t testing.TB) {
	t.Helper()
	if err := bpf.Supported(); err != nil {
		t.Skipf("kernel cannot run the eBPF datapath: %v", err)
	}
}

// sendUDP4 sends one UDP datagram from inside the pod with the given IPv4
// source, written by hand (IP_HDRINCL) so that it can be a spoofed one.
func sendUDP4(t testing.TB, from ns.NetNS, src, dst netip.Addr) {
	t.Helper()
	payload := []byte("kvipam-spoof-test")
	udp := make([]byte, 8+len(payload))
	binary.BigEndian.PutUint16(udp[0:], 40000)
	binary.BigEndian.PutUint16(udp[2:], 40001)
	binary.BigEndian.PutUint16(udp[4:], uint16(len(udp)))
	copy(udp[8:], payload) // UDP checksum 0: none, allowed for IPv4
	ip := make([]byte, 20)
	ip[0], ip[8], ip[9] = 0x45, 64, unix.IPPROTO_UDP
	binary.BigEndian.PutUint16(ip[2:], uint16(20+len(udp)))
	s4, d4 := src.As4(), dst.As4()
	copy(ip[12:], s4[:])
	copy(ip[16:], d4[:])
	var sum uint32
	for i := 0; i < 20; i += 2 {
		sum += uint32(binary.BigEndian.Uint16(ip[i:]))
	}
	for sum > 0xffff {
		sum = sum&0xffff + sum>>16
	}
	binary.BigEndian.PutUint16(ip[10:], ^uint16(sum))
	require.NoError(t, from.Do(func(ns.NetNS) error {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW, unix.IPPROTO_RAW)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		return unix.Sendto(fd, append(ip, udp...), 0, &unix.SockaddrInet4{Addr: d4})
	}))
}

// dropped reads the endpoint's dropped-packet counter from the agent.
func (n *node) dropped(t testing.TB, containerID string) uint64 {
	t.Helper()
	eps, err := n.client().EndpointStats(context.Background())
	require.NoError(t, err)
	for _, ep := range eps {
		if ep.Owner.ContainerID == containerID && ep.Counters != nil {
			return ep.Counters.DroppedPackets
		}
	}
	t.Fatalf("no counters for %s in %v", containerID, eps)
	return 0
}

// TestBPFEnforcesThroughAgentKill: in bpf mode a pod's spoofed packets are
// dropped and counted as soon as ADD returns; the agent killed with
// SIGKILL leaves the program enforcing; the restarted agent adopts the
// same link; DEL leaves no link behind.
func TestBPFEnforcesThroughAgentKill(t *testing.T) {
	requireBPF(t)
	n := newNode(t, "bpfkill")
	n.startAgent(agentOpts{pools: []string{dualStackPool}, datapath: "bpf"})
	l := n.kvipamList("kv", "1.0.0", "")
	p := newPod(t, "spoofer")
	r := n.mustAdd(l, p)
	own, _ := podAddrs(t, r)
	id := p.rt.ContainerID

	linkID := func() link.ID {
		eps, err := n.client().Endpoints(context.Background())
		require.NoError(t, err)
		require.Len(t, eps, 1)
		pins := filepath.Join("/sys/fs/bpf", "kvipam-e2e-"+filepath.Base(n.dir), "links", fmt.Sprint(eps[0].HostIfIndex))
		lk, err := link.LoadPinnedLink(pins, nil)
		require.NoError(t, err, "pinned link of the endpoint")
		defer lk.Close()
		info, err := lk.Info()
		require.NoError(t, err)
		return info.ID
	}
	before := linkID()

	require.NoError(t, ping(p.ns, hostAddrV4), "own traffic passes")
	base := n.dropped(t, id)
	sendUDP4(t, p.ns, netip.MustParseAddr("10.1.250.250"), hostAddrV4)
	sendUDP4(t, p.ns, netip.MustParseAddr("198.51.100.7"), hostAddrV4)
	sendUDP4(t, p.ns, own, hostAddrV4)
	require.Equal(t, base+2, n.dropped(t, id), "two spoofed packets dropped, the own-source one passed")

	n.killAgent()
	sendUDP4(t, p.ns, netip.MustParseAddr("10.1.250.251"), hostAddrV4) // while no agent runs
	n.restartAgent()
	require.Equal(t, before, linkID(), "the restarted agent adopted the link without detaching it")
	require.Equal(t, base+3, n.dropped(t, id), "the program kept dropping while the agent was dead")
	require.NoError(t, ping(p.ns, hostAddrV4))

	require.NoError(t, n.del(l, p))
	eps, err := n.client().Endpoints(context.Background())
	require.NoError(t, err)
	require.Empty(t, eps)
	entries, err := os.ReadDir(filepath.Join("/sys/fs/bpf", "kvipam-e2e-"+filepath.Base(n.dir), "links"))
	require.NoError(t, err)
	require.Empty(t, entries, "DEL leaves no pinned link")
}

// attachedWith says how the bpf datapath's program is attached to p's host
// veth: "tcx", "tc" (a clsact or ingress filter) or "" (not at all).
func (n *node) attachedWith(t testing.TB, p *pod) string {
	t.Helper()
	how := ""
	require.NoError(t, n.do(func() error {
		l, err := netlink.LinkByName(cni.HostVethName(p.rt.ContainerID, p.rt.IfName))
		if err != nil {
			return err
		}
		res, err := link.QueryPrograms(link.QueryOptions{Target: l.Attrs().Index, Attach: ebpf.AttachTCXIngress})
		if err == nil && len(res.Programs) > 0 {
			how = "tcx"
			return nil
		}
		filters, err := netlink.FilterList(l, netlink.HANDLE_MIN_INGRESS)
		if err != nil {
			return nil // no ingress qdisc: no filter
		}
		for _, f := range filters {
			if _, ok := f.(*netlink.BpfFilter); ok {
				how = "tc"
			}
		}
		return nil
	}))
	return how
}
