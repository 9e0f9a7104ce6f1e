package e2e

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/kvipam/kvipam/cni"
)

// Host ports served by the bpf datapath (docs/design.md, "Host ports"):
// two nodes on an underlay, node a's pods map host ports, and clients in
// node b's namespace, node a's own, and pods of node a reach them.

var (
	underlayA   = netip.MustParseAddr("10.254.0.1")
	underlayA6  = netip.MustParseAddr("fd00:254::1")
	underlayB6  = netip.MustParseAddr("fd00:254::2")
	hostPortTCP = 8080
	hostPortUDP = 8081
)

// hostPortRig is two nodes running the bpf datapath, a's etcd shared.
type hostPortRig struct {
	a, b   *node
	la, lb *libcni.NetworkConfigList
}

func newHostPortRig(t *testing.T) *hostPortRig {
	t.Helper()
	requireBPF(t)
	a, b := newNode(t, "ha"), newNode(t, "hb")
	underlay(t, a, b)
	for _, side := range []struct {
		n    *node
		addr netip.Addr
	}{{a, underlayA6}, {b, underlayB6}} {
		h := nlHandle(t, side.n.host)
		ul, err := h.LinkByName("ul0")
		require.NoError(t, err)
		require.NoError(t, h.AddrAdd(ul, &netlink.Addr{IPNet: ipNet(netip.PrefixFrom(side.addr, 64)), Flags: unix.IFA_F_NODAD}))
	}
	const pool = "default=10.1.0.0/16,fd10::/112"
	const etcd = "http://10.254.0.1:2379"
	a.startAgent(agentOpts{pools: []string{pool}, datapath: "bpf", extra: []string{"--embedded-etcd-listen", etcd, "--node-address", "10.254.0.1"}})
	b.startAgent(agentOpts{pools: []string{pool}, datapath: "bpf", etcdURL: etcd, extra: []string{"--node-address", "10.254.0.2"}})
	// As kube-proxy does (KUBE-FORWARD): a node drops forwarded frames
	// its conntrack finds INVALID, such as a reply to a flow it never
	// saw. Translated flows must not depend on netfilter seeing them.
	require.NoError(t, a.do(func() error {
		cmd := exec.Command("nft", "-f", "-")
		cmd.Stdin = strings.NewReader("table inet kvtest {\n chain kvfwd {\n  type filter hook forward priority 0; policy accept;\n  ct state invalid drop\n }\n}\n")
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("nft: %w: %s", err, out)
		}
		return nil
	}))
	caps := `,"capabilities":{"portMappings":true}`
	return &hostPortRig{a: a, b: b, la: a.kvipamList("kv", "1.0.0", caps), lb: b.kvipamList("kv", "1.0.0", caps)}
}

// mapping is one portMappings entry as a runtime passes it.
func mapping(proto string, hostPort, containerPort int, hostIP string) map[string]any {
	m := map[string]any{"hostPort": hostPort, "containerPort": containerPort, "protocol": proto}
	if hostIP != "" {
		m["hostIP"] = hostIP
	}
	return m
}

// servingPod is a pod with the given mappings and echo servers on TCP 80
// and UDP 81, added on n.
func servingPod(t *testing.T, n *node, l *libcni.NetworkConfigList, name string, maps ...map[string]any) (*pod, error) {
	t.Helper()
	p := newPod(t, name)
	p.rt.CapabilityArgs = map[string]any{"portMappings": maps}
	if _, err := n.add(l, p); err != nil {
		return p, err
	}
	echoServer(t, p, 80, 81)
	return p, nil
}

// echoServer answers, in p's namespace, each TCP connection to tcpPort and
// each UDP datagram to udpPort with "<pod> <the client's address>".
func echoServer(t *testing.T, p *pod, tcpPort, udpPort int) {
	t.Helper()
	var ln net.Listener
	var pc net.PacketConn
	require.NoError(t, p.ns.Do(func(ns.NetNS) (err error) {
		if ln, err = net.Listen("tcp", fmt.Sprintf(":%d", tcpPort)); err != nil {
			return err
		}
		pc, err = net.ListenPacket("udp", fmt.Sprintf(":%d", udpPort))
		return err
	}))
	t.Cleanup(func() { _ = ln.Close(); _ = pc.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			_, _ = fmt.Fprintf(c, "%s %s", p.name, unmapped(c.RemoteAddr().String()))
			_ = c.Close()
		}
	}()
	go func() {
		buf := make([]byte, 64)
		for {
			_, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			_, _ = pc.WriteTo([]byte(fmt.Sprintf("%s %s", p.name, unmapped(from.String()))), from)
		}
	}()
}

func unmapped(s string) string {
	if ap, err := netip.ParseAddrPort(s); err == nil {
		return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()).String()
	}
	return s
}

// echo connects from the namespace from to dst and returns the answer and
// the address the client's socket saw the answer come from. A host port
// not served is refused (TCP: the node's RST) or unanswered (5 s).
func echo(from ns.NetNS, proto string, dst netip.AddrPort) (answer, peer string, err error) {
	err = from.Do(func(ns.NetNS) error {
		c, err := net.DialTimeout(proto, dst.String(), 5*time.Second)
		if err != nil {
			return err
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		if proto == "udp" {
			if _, err := c.Write([]byte("x")); err != nil {
				return err
			}
			buf := make([]byte, 128)
			n, err := c.Read(buf)
			if err != nil {
				return err
			}
			answer = string(buf[:n])
		} else {
			b, err := io.ReadAll(c)
			if err != nil {
				return err
			}
			answer = string(b)
		}
		peer = unmapped(c.RemoteAddr().String())
		return nil
	})
	return answer, peer, err
}

// mustEcho requires that dst answers from pod want, and returns the client
// address the pod saw.
func mustEcho(t *testing.T, from ns.NetNS, proto string, dst netip.AddrPort, want string) string {
	t.Helper()
	answer, peer, err := echo(from, proto, dst)
	require.NoError(t, err, "%s to %s", proto, dst)
	require.Equal(t, dst.String(), peer, "%s to %s: the client's socket sees the host port", proto, dst)
	name, seen, _ := strings.Cut(answer, " ")
	require.Equal(t, want, name, "%s to %s answered by %q", proto, dst, answer)
	return seen
}

// hostPortEntries counts n's datapath's host port mappings and translated
// flows, from its pins.
func hostPortEntries(t *testing.T, n *node) (mappings, flows int) {
	t.Helper()
	pins := filepath.Join("/sys/fs/bpf", "kvipam-e2e-"+filepath.Base(n.dir))
	count := func(name string) int {
		m, err := ebpf.LoadPinnedMap(filepath.Join(pins, name), nil)
		require.NoError(t, err)
		defer m.Close()
		var k, v []byte
		it := m.Iterate()
		c := 0
		for it.Next(&k, &v) {
			c++
		}
		require.NoError(t, it.Err())
		return c
	}
	return count("kvipam_hostports"), count("kvipam_nat")
}

func ap(a netip.Addr, port int) netip.AddrPort { return netip.AddrPortFrom(a, uint16(port)) }

// TestHostPortFromAnotherNode: a pod's TCP and UDP host ports on every
// address of node a, and one on a hostIP only, are reached from node b's
// namespace and from a pod on node b, whose address the pod sees; after
// DEL nothing answers and the datapath holds no entry.
func TestHostPortFromAnotherNode(t *testing.T) {
	r := newHostPortRig(t)
	srv, err := servingPod(t, r.a, r.la, "hp-srv",
		mapping("tcp", hostPortTCP, 80, ""), mapping("udp", hostPortUDP, 81, ""), mapping("tcp", 8090, 80, underlayA.String()))
	require.NoError(t, err)
	cli := newPod(t, "hp-cli")
	r.b.mustAdd(r.lb, cli)
	waitFor(t, 10*time.Second, "node b to route node a's block", func() bool {
		return ping(cli.ns, underlayA) == nil
	})

	for _, proto := range []string{"tcp", "udp"} {
		port := hostPortTCP
		if proto == "udp" {
			port = hostPortUDP
		}
		seen := mustEcho(t, r.b.host, proto, ap(underlayA, port), "hp-srv")
		require.True(t, strings.HasPrefix(seen, "10.254.0.2:"), "the pod sees node b's address, got %s", seen)
		// Node b masquerades its pods' traffic to addresses outside the
		// pools (host-gw's default): the pod sees node b's address.
		seen = mustEcho(t, cli.ns, proto, ap(underlayA, port), "hp-srv")
		require.True(t, strings.HasPrefix(seen, "10.254.0.2:"), "the pod sees node b's address for its pod, got %s", seen)
	}
	mustEcho(t, r.b.host, "tcp", ap(underlayA, 8090), "hp-srv")

	require.NoError(t, r.a.del(r.la, srv))
	_, _, err = echo(r.b.host, "tcp", ap(underlayA, hostPortTCP))
	require.Error(t, err, "after DEL the host port is not served")
	mappings, flows := hostPortEntries(t, r.a)
	require.Zero(t, mappings, "no mapping left after DEL")
	require.Zero(t, flows, "no translated flow left after DEL")
}

// TestHostPortHairpin: the node's own processes (to its uplink address and
// to an address on lo) and the node's pods, the serving pod itself too,
// reach a host port, TCP and UDP, and a hostIP mapping is served on that
// address only.
func TestHostPortHairpin(t *testing.T) {
	r := newHostPortRig(t)
	self, err := servingPod(t, r.a, r.la, "hp-srv",
		mapping("tcp", hostPortTCP, 80, ""), mapping("udp", hostPortUDP, 81, ""), mapping("tcp", 8090, 80, underlayA.String()))
	require.NoError(t, err)
	peer := newPod(t, "hp-peer")
	peerV4, _ := podAddrs(t, r.a.mustAdd(r.la, peer))

	for _, proto := range []string{"tcp", "udp"} {
		port := hostPortTCP
		if proto == "udp" {
			port = hostPortUDP
		}
		for _, dst := range []netip.Addr{underlayA, hostAddrV4} {
			seen := mustEcho(t, r.a.host, proto, ap(dst, port), "hp-srv")
			require.True(t, strings.HasPrefix(seen, dst.String()+":"), "from the node: the pod sees the node's address %s, got %s", dst, seen)
			seen = mustEcho(t, peer.ns, proto, ap(dst, port), "hp-srv")
			require.True(t, strings.HasPrefix(seen, peerV4.String()+":"), "from a pod: the pod sees its address, got %s", seen)
			seen = mustEcho(t, self.ns, proto, ap(dst, port), "hp-srv")
			require.True(t, strings.HasPrefix(seen, dst.String()+":"), "the pod itself: it sees the address it dialed, got %s", seen)
		}
	}
	mustEcho(t, r.a.host, "tcp", ap(underlayA, 8090), "hp-srv")
	mustEcho(t, peer.ns, "tcp", ap(underlayA, 8090), "hp-srv")
	_, _, err = echo(peer.ns, "tcp", ap(hostAddrV4, 8090))
	require.Error(t, err, "a hostIP mapping is not served on the node's other addresses")
}

// TestHostPortIPv6: the same paths over IPv6: another node, the node
// itself (uplink and lo addresses), a pod of the node, the pod itself.
func TestHostPortIPv6(t *testing.T) {
	r := newHostPortRig(t)
	srv, err := servingPod(t, r.a, r.la, "hp-srv", mapping("tcp", hostPortTCP, 80, ""), mapping("udp", hostPortUDP, 81, ""))
	require.NoError(t, err)
	peer := newPod(t, "hp-peer")
	_, peerV6 := podAddrs(t, r.a.mustAdd(r.la, peer))
	require.True(t, peerV6.IsValid())

	for _, proto := range []string{"tcp", "udp"} {
		port := hostPortTCP
		if proto == "udp" {
			port = hostPortUDP
		}
		seen := mustEcho(t, r.b.host, proto, ap(underlayA6, port), "hp-srv")
		require.True(t, strings.HasPrefix(seen, "["+underlayB6.String()+"]:"), "the pod sees node b's address, got %s", seen)
		for _, dst := range []netip.Addr{underlayA6, hostAddrV6} {
			seen = mustEcho(t, r.a.host, proto, ap(dst, port), "hp-srv")
			require.True(t, strings.HasPrefix(seen, "["+dst.String()+"]:"), "from the node, got %s", seen)
			seen = mustEcho(t, peer.ns, proto, ap(dst, port), "hp-srv")
			require.True(t, strings.HasPrefix(seen, "["+peerV6.String()+"]:"), "from a pod, got %s", seen)
			seen = mustEcho(t, srv.ns, proto, ap(dst, port), "hp-srv")
			require.True(t, strings.HasPrefix(seen, "["+dst.String()+"]:"), "the pod itself, got %s", seen)
		}
	}
}

// TestHostPortConflictRefused: a second pod's mapping that overlaps the
// first's (same protocol and port, its hostIP inside the first's every
// address) is refused with ErrCodePortInUse naming the first pod, and the
// refused ADD leaves nothing: no endpoint, no address, no veth, no map
// entry. The same port over UDP is another mapping and is served.
func TestHostPortConflictRefused(t *testing.T) {
	r := newHostPortRig(t)
	_, err := servingPod(t, r.a, r.la, "hp-first", mapping("tcp", hostPortTCP, 80, ""))
	require.NoError(t, err)
	before, _ := hostPortEntries(t, r.a)

	second := newPod(t, "hp-second")
	second.rt.CapabilityArgs = map[string]any{"portMappings": []map[string]any{mapping("tcp", hostPortTCP, 80, underlayA.String())}}
	_, err = r.a.add(r.la, second)
	require.Error(t, err)
	var te *types.Error
	require.True(t, errors.As(err, &te), "a CNI error: %v", err)
	require.Equal(t, cni.ErrCodePortInUse, te.Code, "%v", err)
	require.Contains(t, te.Msg, "e2e/hp-first", "the message names the pod holding the port")

	eps, err := r.a.client().Endpoints(context.Background())
	require.NoError(t, err)
	require.Len(t, eps, 1, "the refused pod has no endpoint")
	for _, fam := range []string{"ipv4", "ipv6"} {
		st := r.a.poolStatus("default", fam)
		require.Equal(t, 1, st.Used, "%s: only the first pod holds an address", fam)
		require.Zero(t, st.Reserved, "%s: the refused ADD's reservation is released", fam)
	}
	after, _ := hostPortEntries(t, r.a)
	require.Equal(t, before, after, "the refused mappings left no entry")
	links, err := nlHandle(t, r.a.host).LinkList()
	require.NoError(t, err)
	veths := 0
	for _, l := range links {
		if strings.HasPrefix(l.Attrs().Name, "kv") && l.Attrs().Group != 0x6b766970 {
			veths++
		}
	}
	require.Equal(t, 1, veths, "the refused pod's veth is gone")
	mustEcho(t, r.b.host, "tcp", ap(underlayA, hostPortTCP), "hp-first")

	third := newPod(t, "hp-udp")
	third.rt.CapabilityArgs = map[string]any{"portMappings": []map[string]any{mapping("udp", hostPortTCP, 81, "")}}
	r.a.mustAdd(r.la, third)
	echoServer(t, third, 80, 81)
	mustEcho(t, r.b.host, "udp", ap(underlayA, hostPortTCP), "hp-udp")
}

// TestHostPortSurvivesAgentRestart: a host port keeps being served while
// the agent is killed and after it starts again, which adopts the pinned
// mappings; DEL then removes them.
func TestHostPortSurvivesAgentRestart(t *testing.T) {
	r := newHostPortRig(t)
	srv, err := servingPod(t, r.a, r.la, "hp-srv", mapping("tcp", hostPortTCP, 80, ""), mapping("udp", hostPortUDP, 81, ""))
	require.NoError(t, err)
	mustEcho(t, r.b.host, "tcp", ap(underlayA, hostPortTCP), "hp-srv")

	r.a.killAgent()
	mustEcho(t, r.b.host, "tcp", ap(underlayA, hostPortTCP), "hp-srv")
	mustEcho(t, r.a.host, "udp", ap(hostAddrV4, hostPortUDP), "hp-srv")
	r.a.startAgent(r.a.agentArgs)
	mustEcho(t, r.b.host, "tcp", ap(underlayA, hostPortTCP), "hp-srv")
	mustEcho(t, r.a.host, "udp", ap(hostAddrV4, hostPortUDP), "hp-srv")
	eps, err := r.a.client().Endpoints(context.Background())
	require.NoError(t, err)
	require.Len(t, eps, 1)
	require.Len(t, eps[0].PortMappings, 2, "the endpoint record keeps its mappings")

	require.NoError(t, r.a.del(r.la, srv))
	mappings, _ := hostPortEntries(t, r.a)
	require.Zero(t, mappings)
}
