package e2e

import (
	"context"
	"encoding/binary"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

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

// TestBPFEnforcesThroughAgentKill: in bpf mode, attached either way, a
// pod's spoofed packets are dropped and counted as soon as ADD returns;
// the agent killed with SIGKILL leaves the program enforcing; the
// restarted agent adopts the same attachment; DEL leaves nothing behind.
func TestBPFEnforcesThroughAgentKill(t *testing.T) {
	requireBPF(t)
	for _, mode := range []string{"auto", "tcx"} {
		t.Run(mode, func(t *testing.T) { testBPFEnforcesThroughAgentKill(t, mode) })
	}
}

func testBPFEnforcesThroughAgentKill(t *testing.T, mode string) {
	n := newNode(t, "bpfkill"+mode)
	n.startAgent(agentOpts{pools: []string{dualStackPool}, datapath: "bpf", extra: []string{"--bpf-attach", mode}})
	l := n.kvipamList("kv", "1.0.0", "")
	p := newPod(t, "spoofer")
	r := n.mustAdd(l, p)
	own, _ := podAddrs(t, r)
	id := p.rt.ContainerID
	pins := filepath.Join("/sys/fs/bpf", "kvipam-e2e-"+filepath.Base(n.dir), "links")

	attachment := func() string {
		eps, err := n.client().Endpoints(context.Background())
		require.NoError(t, err)
		require.Len(t, eps, 1)
		how := n.attachmentOf(t, eps[0].HostIfIndex)
		if mode == "auto" {
			require.Contains(t, how, "tc program", "auto attaches a pod without egress limits with a clsact filter")
		} else {
			require.Contains(t, how, "tcx link")
		}
		return how
	}
	before := attachment()

	require.NoError(t, ping(p.ns, hostAddrV4), "own traffic passes")
	base := n.dropped(t, id)
	sendUDP4(t, p.ns, netip.MustParseAddr("10.1.250.250"), hostAddrV4)
	sendUDP4(t, p.ns, netip.MustParseAddr("198.51.100.7"), hostAddrV4)
	sendUDP4(t, p.ns, own, hostAddrV4)
	require.Equal(t, base+2, n.dropped(t, id), "two spoofed packets dropped, the own-source one passed")

	n.killAgent()
	sendUDP4(t, p.ns, netip.MustParseAddr("10.1.250.251"), hostAddrV4) // while no agent runs
	n.restartAgent()
	require.Equal(t, before, attachment(), "the restarted agent adopted the attachment without detaching it")
	require.Equal(t, base+3, n.dropped(t, id), "the program kept dropping while the agent was dead")
	require.NoError(t, ping(p.ns, hostAddrV4))

	require.NoError(t, n.del(l, p))
	eps, err := n.client().Endpoints(context.Background())
	require.NoError(t, err)
	require.Empty(t, eps)
	// The agent deletes the retired veth, then its link's pin, after DEL.
	waitFor(t, 30*time.Second, "DEL to leave no pinned link", func() bool {
		entries, err := os.ReadDir(pins)
		require.NoError(t, err)
		return len(entries) == 0
	})
}

// attachedWith says how the bpf datapath's program is attached to p's host
// veth: "tcx", "tc" (a clsact or ingress filter) or "" (not at all).
func (n *node) attachedWith(t testing.TB, p *pod) string {
	t.Helper()
	var index int
	require.NoError(t, n.do(func() error {
		l, err := netlink.LinkByName(cni.HostVethName(p.rt.ContainerID, p.rt.IfName))
		if err == nil {
			index = l.Attrs().Index
		}
		return err
	}))
	how, _, _ := strings.Cut(n.attachmentOf(t, index), " ")
	return how
}

// attachmentOf names what attaches the program to the host interface
// ifindex: "tcx link <link ID>" (pinned by the agent), "tc program <ID>"
// (a clsact or ingress filter), or "" (nothing).
func (n *node) attachmentOf(t testing.TB, ifindex int) string {
	t.Helper()
	how := ""
	require.NoError(t, n.do(func() error {
		res, err := link.QueryPrograms(link.QueryOptions{Target: ifindex, Attach: ebpf.AttachTCXIngress})
		if err == nil && len(res.Programs) > 0 {
			pin := filepath.Join("/sys/fs/bpf", "kvipam-e2e-"+filepath.Base(n.dir), "links", fmt.Sprint(ifindex))
			lk, err := link.LoadPinnedLink(pin, nil)
			if err != nil {
				return fmt.Errorf("a TCX program without the agent's pinned link: %w", err)
			}
			defer lk.Close()
			info, err := lk.Info()
			if err != nil {
				return err
			}
			how = fmt.Sprint("tcx link ", info.ID)
			return nil
		}
		filters, err := netlink.FilterList(&netlink.Device{LinkAttrs: netlink.LinkAttrs{Index: ifindex}}, netlink.HANDLE_MIN_INGRESS)
		if err != nil {
			return nil // no ingress qdisc: no filter
		}
		for _, f := range filters {
			if bf, ok := f.(*netlink.BpfFilter); ok {
				how = fmt.Sprint("tc program ", bf.Id)
			}
		}
		return nil
	}))
	return how
}
