//go:build linux

package bpf

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/hashicorp/go-hclog"
	"github.com/kvipam/kvipam/internal/testsupport/nstest"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// Every test builds its own "host" network namespace with pods in their own
// namespaces behind veth pairs, as the CNI plugin does; nothing touches the
// real host's links, routes or sysctls, and every packet stays inside them.

var (
	gatewayV4 = netip.MustParseAddr("169.254.1.1")
	gatewayV6 = netip.MustParseAddr("fe80::1")
	// The host receives on these, on an interface of its own.
	recvV4 = netip.MustParseAddr("10.99.0.1")
	recvV6 = netip.MustParseAddr("fd00:99::1")
)

const recvPort = 9999

// requireRoot skips tests that create namespaces and load programs.
func requireRoot(tb testing.TB) {
	tb.Helper()
	if os.Geteuid() != 0 {
		tb.Skip("needs root: creates network namespaces and loads eBPF programs")
	}
}

// requireDatapath skips when this kernel cannot run the datapath, found out
// by trying (Supported loads and attaches the program).
var supported = sync.OnceValue(Supported)

func requireDatapath(tb testing.TB) {
	tb.Helper()
	requireRoot(tb)
	if err := supported(); err != nil {
		tb.Skipf("kernel cannot run the eBPF datapath: %v", err)
	}
}

func newNS(tb testing.TB) ns.NetNS {
	tb.Helper()
	return nstest.NewNS(tb)
}

func inNS(tb testing.TB, n ns.NetNS, fn func() error) {
	tb.Helper()
	require.NoError(tb, n.Do(func(ns.NetNS) error { return fn() }))
}

// sysctls sets sysctls of the namespace n (never the real host's: /proc/sys/net
// shows the namespace of the thread that opens it, which ns.Do locks).
func sysctls(tb testing.TB, n ns.NetNS, kv map[string]string) {
	tb.Helper()
	inNS(tb, n, func() error {
		for k, v := range kv {
			p := filepath.Join("/proc/sys", strings.ReplaceAll(k, ".", "/"))
			if err := os.WriteFile(p, []byte(v), 0o644); err != nil {
				return err
			}
		}
		return nil
	})
}

func nsHandle(n ns.NetNS) netns.NsHandle { return netns.NsHandle(int(n.Fd())) }

func handleAt(tb testing.TB, n ns.NetNS) *netlink.Handle {
	tb.Helper()
	h, err := netlink.NewHandleAt(nsHandle(n))
	require.NoError(tb, err)
	tb.Cleanup(h.Close)
	return h
}

// host is the scratch host namespace.
type host struct {
	ns ns.NetNS
	h  *netlink.Handle
	// recv receives UDP on recvV4 and recvV6.
	recv4, recv6 *receiver
}

// pod is one pod namespace and its veth pair.
type pod struct {
	ns        ns.NetNS
	h         *netlink.Handle
	ifindex   int              // eth0 in the pod
	mac       net.HardwareAddr // eth0 in the pod
	hostIf    netlink.Link     // the host side
	hostMAC   net.HardwareAddr
	v4, v6    netip.Addr
	linkLocal netip.Addr
	ep        Endpoint
}

func newHost(tb testing.TB) *host {
	tb.Helper()
	hn := newNS(tb)
	sysctls(tb, hn, map[string]string{
		"net.ipv6.conf.all.accept_dad":     "0",
		"net.ipv6.conf.default.accept_dad": "0",
		"net.ipv4.conf.all.rp_filter":      "0",
		"net.ipv4.conf.default.rp_filter":  "0",
	})
	hh := handleAt(tb, hn)
	lo, err := hh.LinkByName("lo")
	require.NoError(tb, err)
	require.NoError(tb, hh.LinkSetUp(lo))
	// A veth pair rather than a dummy: not every kernel has the dummy driver.
	recv := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "recv0"}, PeerName: "recv1"}
	require.NoError(tb, hh.LinkAdd(recv))
	for _, name := range []string{"recv0", "recv1"} {
		l, err := hh.LinkByName(name)
		require.NoError(tb, err)
		require.NoError(tb, hh.LinkSetUp(l))
	}
	addAddr(tb, hh, recv, recvV4, 32)
	addAddr(tb, hh, recv, recvV6, 128)

	h := &host{ns: hn, h: hh}
	h.recv4 = listen(tb, hn, recvV4)
	h.recv6 = listen(tb, hn, recvV6)
	return h
}

func addAddr(tb testing.TB, h *netlink.Handle, l netlink.Link, a netip.Addr, bits int) {
	tb.Helper()
	addr := &netlink.Addr{IPNet: &net.IPNet{IP: a.AsSlice(), Mask: net.CIDRMask(bits, a.BitLen())}}
	if a.Is6() {
		addr.Flags = unix.IFA_F_NODAD
	}
	require.NoError(tb, h.AddrAdd(l, addr))
}

// addPod creates pod number i (1-based) with 10.244.0.<4+i>/32 and
// fd00:244::<4+i>/128, routed via the link-local gateways, and the host
// routes back to it, like the CNI plugin and the agent do.
func (h *host) addPod(tb testing.TB, i int) *pod {
	tb.Helper()
	pn := newNS(tb)
	sysctls(tb, pn, map[string]string{
		"net.ipv6.conf.all.accept_dad":     "0",
		"net.ipv6.conf.default.accept_dad": "0",
	})
	ph := handleAt(tb, pn)
	hostName := fmt.Sprintf("kvh%d", i)
	veth := &netlink.Veth{
		LinkAttrs:     netlink.LinkAttrs{Name: hostName},
		PeerName:      "eth0",
		PeerNamespace: netlink.NsFd(int(pn.Fd())),
	}
	require.NoError(tb, h.h.LinkAdd(veth))

	p := &pod{ns: pn, h: ph,
		v4: netip.MustParseAddr(fmt.Sprintf("10.244.0.%d", 4+i)),
		v6: netip.MustParseAddr(fmt.Sprintf("fd00:244::%d", 4+i)),
	}
	hostIf, err := h.h.LinkByName(hostName)
	require.NoError(tb, err)
	require.NoError(tb, h.h.LinkSetUp(hostIf))
	addAddr(tb, h.h, hostIf, gatewayV4, 32)
	addAddr(tb, h.h, hostIf, gatewayV6, 64)
	for _, a := range []netip.Addr{p.v4, p.v6} {
		dst := &net.IPNet{IP: a.AsSlice(), Mask: net.CIDRMask(a.BitLen(), a.BitLen())}
		require.NoError(tb, h.h.RouteAdd(&netlink.Route{LinkIndex: hostIf.Attrs().Index, Dst: dst, Scope: netlink.SCOPE_LINK}))
	}
	p.hostIf, p.hostMAC = hostIf, hostIf.Attrs().HardwareAddr

	lo, err := ph.LinkByName("lo")
	require.NoError(tb, err)
	require.NoError(tb, ph.LinkSetUp(lo))
	eth0, err := ph.LinkByName("eth0")
	require.NoError(tb, err)
	require.NoError(tb, ph.LinkSetUp(eth0))
	p.ifindex, p.mac = eth0.Attrs().Index, eth0.Attrs().HardwareAddr
	addAddr(tb, ph, eth0, p.v4, 32)
	addAddr(tb, ph, eth0, p.v6, 128)
	gw4 := &net.IPNet{IP: gatewayV4.AsSlice(), Mask: net.CIDRMask(32, 32)}
	require.NoError(tb, ph.RouteAdd(&netlink.Route{LinkIndex: p.ifindex, Dst: gw4, Scope: netlink.SCOPE_LINK}))
	require.NoError(tb, ph.RouteAdd(&netlink.Route{LinkIndex: p.ifindex, Gw: gatewayV4.AsSlice()}))
	require.NoError(tb, ph.RouteAdd(&netlink.Route{LinkIndex: p.ifindex, Gw: gatewayV6.AsSlice(),
		Dst: &net.IPNet{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)}}))
	p.linkLocal = netip.AddrFrom16([16]byte{0: 0xfe, 1: 0x80, 14: 0x0a, 15: byte(i)}) // fe80::a<i>, not the gateway
	addAddr(tb, ph, eth0, p.linkLocal, 64)

	p.ep = Endpoint{
		ID:          uint32(100 + i),
		HostIfIndex: hostIf.Attrs().Index,
		HostIfName:  hostName,
		MAC:         p.mac,
		IPs:         []netip.Addr{p.v4, p.v6},
	}
	return p
}

// sendFrame sends a raw Ethernet frame out of the pod's eth0, so it arrives
// on the host veth's ingress, where the program runs.
func (p *pod) sendFrame(tb testing.TB, frame []byte) {
	tb.Helper()
	inNS(tb, p.ns, func() error {
		fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		sa := &unix.SockaddrLinklayer{Ifindex: p.ifindex, Halen: 6}
		copy(sa.Addr[:], p.hostMAC)
		return unix.Sendto(fd, frame, 0, sa)
	})
}

// sendUDP sends through the pod's own stack (routes, ARP, NDP), as an
// application in the pod would.
func (p *pod) sendUDP(tb testing.TB, to netip.Addr, payload string) {
	tb.Helper()
	inNS(tb, p.ns, func() error {
		c, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(netip.AddrPortFrom(to, recvPort)))
		if err != nil {
			return err
		}
		defer c.Close()
		_, err = c.Write([]byte(payload))
		return err
	})
}

// receiver is a UDP socket in the host namespace.
type receiver struct{ c *net.UDPConn }

func listen(tb testing.TB, n ns.NetNS, a netip.Addr) *receiver {
	tb.Helper()
	var r receiver
	inNS(tb, n, func() error {
		c, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.AddrPortFrom(a, recvPort)))
		r.c = c
		return err
	})
	tb.Cleanup(func() { _ = r.c.Close() })
	return &r
}

// got reports whether a datagram with payload arrives within wait, and from
// which source.
func (r *receiver) got(payload string, wait time.Duration) (netip.Addr, bool) {
	buf := make([]byte, 2048)
	deadline := time.Now().Add(wait)
	for {
		_ = r.c.SetReadDeadline(deadline)
		n, from, err := r.c.ReadFromUDPAddrPort(buf)
		if err != nil {
			return netip.Addr{}, false
		}
		if string(buf[:n]) == payload {
			return from.Addr().Unmap(), true
		}
	}
}

func (h *host) receiver(a netip.Addr) *receiver {
	if a.Is4() {
		return h.recv4
	}
	return h.recv6
}

// token makes payloads unique, so a late datagram never satisfies a later check.
func token(tb testing.TB, what string) string {
	tb.Helper()
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	return what + "-" + hex.EncodeToString(b)
}

// pinDir returns a fresh directory on bpffs, mounting bpffs at /sys/fs/bpf
// if nothing is mounted there, and removes it (unpinning everything, which
// detaches any link a test left) at the end of the test.
func pinDir(tb testing.TB) string {
	tb.Helper()
	var st unix.Statfs_t
	require.NoError(tb, unix.Statfs("/sys/fs/bpf", &st))
	if uint32(st.Type) != unix.BPF_FS_MAGIC {
		require.NoError(tb, unix.Mount("bpf", "/sys/fs/bpf", "bpf", 0, "mode=0700"))
	}
	dir := filepath.Join("/sys/fs/bpf", "kvipam-test-"+token(tb, "pins"))
	tb.Cleanup(func() { _ = os.RemoveAll(dir) })
	return dir
}

func openDatapath(tb testing.TB, dir string) *Datapath {
	tb.Helper()
	log := hclog.New(&hclog.LoggerOptions{Name: tb.Name(), Level: hclog.Debug, Output: hclogWriter{tb}})
	d, err := Open(dir, log)
	require.NoError(tb, err)
	tb.Cleanup(func() { _ = d.Close() })
	return d
}

type hclogWriter struct{ tb testing.TB }

func (w hclogWriter) Write(p []byte) (int, error) {
	w.tb.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}

// attach, detach and adopt call the Datapath from the host namespace, as the
// agent does from the real host's.
func (h *host) attach(tb testing.TB, d *Datapath, ep Endpoint) {
	tb.Helper()
	inNS(tb, h.ns, func() error { return d.Attach(ep) })
}

func (h *host) detach(tb testing.TB, d *Datapath, ep Endpoint) {
	tb.Helper()
	inNS(tb, h.ns, func() error { return d.Detach(ep) })
}

func (h *host) adopt(tb testing.TB, d *Datapath) []Endpoint {
	tb.Helper()
	var eps []Endpoint
	inNS(tb, h.ns, func() error {
		var err error
		eps, err = d.Adopt()
		return err
	})
	return eps
}

// tcxState is what the kernel says is attached to a host veth's TCX ingress.
type tcxState struct {
	revision uint64
	programs []ebpf.ProgramID
	links    []link.ID
}

func (h *host) tcx(tb testing.TB, ifindex int) tcxState {
	tb.Helper()
	var s tcxState
	inNS(tb, h.ns, func() error {
		res, err := link.QueryPrograms(link.QueryOptions{Target: ifindex, Attach: ebpf.AttachTCXIngress})
		if err != nil {
			return err
		}
		s.revision = res.Revision
		for _, p := range res.Programs {
			s.programs = append(s.programs, p.ID)
			if id, ok := p.LinkID(); ok {
				s.links = append(s.links, id)
			}
		}
		return nil
	})
	return s
}

// pinnedLinkID returns the ID of the link pinned for ifindex.
func pinnedLinkID(tb testing.TB, dir string, ifindex int) link.ID {
	tb.Helper()
	l, err := link.LoadPinnedLink(filepath.Join(dir, linksDir, fmt.Sprint(ifindex)), nil)
	require.NoError(tb, err)
	defer l.Close()
	info, err := l.Info()
	require.NoError(tb, err)
	return info.ID
}

func linkExists(id link.ID) bool {
	l, err := link.NewFromID(id)
	if err != nil {
		return !errors.Is(err, os.ErrNotExist)
	}
	_ = l.Close()
	return true
}
