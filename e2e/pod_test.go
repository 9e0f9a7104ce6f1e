package e2e

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"os"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/stretchr/testify/require"
	"golang.org/x/net/icmp"
	"golang.org/x/net/ipv4"
	"golang.org/x/net/ipv6"
)

// pod is a container's network namespace and its CNI identity.
type pod struct {
	name string
	ns   ns.NetNS
	rt   *libcni.RuntimeConf
}

func newPod(t testing.TB, name string) *pod {
	t.Helper()
	return podIn(name, newNS(t))
}

// podIn is the pod name in namespace n, as a runtime describes it.
func podIn(name string, n ns.NetNS) *pod {
	return &pod{name: name, ns: n, rt: &libcni.RuntimeConf{
		ContainerID: "ctr-" + name, NetNS: n.Path(), IfName: "eth0",
		Args: [][2]string{{"IgnoreUnknown", "1"}, {"K8S_POD_NAMESPACE", "e2e"}, {"K8S_POD_NAME", name}, {"K8S_POD_UID", podUID(name)}},
	}}
}

// podUID is the pod UID a test pod is given (a UUID, as Kubernetes'),
// made from its name.
func podUID(name string) string {
	h := sha256.Sum256([]byte(name))
	return fmt.Sprintf("%x-%x-%x-%x-%x", h[0:4], h[4:6], h[6:8], h[8:10], h[10:16])
}

// conflist parses a network configuration list.
func conflist(t testing.TB, s string) *libcni.NetworkConfigList {
	t.Helper()
	l, err := libcni.ConfListFromBytes([]byte(s))
	require.NoError(t, err, "conflist:\n%s", s)
	return l
}

// kvipamList is a kvipam network on n: kvipam first, then more plugins.
func (n *node) kvipamList(name, version, kvipamExtra string, more ...string) *libcni.NetworkConfigList {
	plugins := fmt.Sprintf(`{"type":"kvipam","agentSocket":%q,"delQueueDir":%q,"agentTimeout":"5s","logLevel":"debug","logFile":%q%s}`,
		n.socket, n.queue, n.dir+"/plugin.log", kvipamExtra)
	for _, m := range more {
		plugins += "," + m
	}
	return conflist(n.t, fmt.Sprintf(`{"cniVersion":%q,"name":%q,"plugins":[%s]}`, version, name, plugins))
}

// add runs ADD for p through libcni in the node namespace.
func (n *node) add(l *libcni.NetworkConfigList, p *pod) (*current.Result, error) {
	return n.addCtx(context.Background(), l, p)
}

// addCtx is add bounded by ctx: when ctx ends, libcni kills the plugin.
func (n *node) addCtx(ctx context.Context, l *libcni.NetworkConfigList, p *pod) (*current.Result, error) {
	var res types.Result
	err := n.do(func() (err error) {
		res, err = n.cni.AddNetworkList(ctx, l, p.rt)
		return err
	})
	if err != nil {
		return nil, err
	}
	return current.NewResultFromResult(res)
}

func (n *node) mustAdd(l *libcni.NetworkConfigList, p *pod) *current.Result {
	n.t.Helper()
	res, err := n.add(l, p)
	require.NoError(n.t, err, "ADD %s on %s", p.name, l.Name)
	return res
}

func (n *node) check(l *libcni.NetworkConfigList, p *pod) error {
	return n.do(func() error { return n.cni.CheckNetworkList(context.Background(), l, p.rt) })
}

func (n *node) del(l *libcni.NetworkConfigList, p *pod) error {
	return n.delCtx(context.Background(), l, p)
}

// delCtx is del bounded by ctx: when ctx ends, libcni kills the plugin.
func (n *node) delCtx(ctx context.Context, l *libcni.NetworkConfigList, p *pod) error {
	return n.do(func() error { return n.cni.DelNetworkList(ctx, l, p.rt) })
}

func (n *node) statusOf(l *libcni.NetworkConfigList) error {
	return n.do(func() error { return n.cni.GetStatusNetworkList(context.Background(), l) })
}

// podAddrs are the addresses of a result, by family.
func podAddrs(t testing.TB, r *current.Result) (v4, v6 netip.Addr) {
	t.Helper()
	for _, ipc := range r.IPs {
		a, ok := netip.AddrFromSlice(ipc.Address.IP)
		require.True(t, ok)
		if a = a.Unmap(); a.Is4() {
			v4 = a
		} else {
			v6 = a
		}
	}
	return v4, v6
}

// ping sends ICMP echo requests from the namespace from to dst until one
// is answered: up to three, a second apart. It uses a raw socket made in
// from, so it needs no ping binary.
func ping(from ns.NetNS, dst netip.Addr) error {
	return from.Do(func(ns.NetNS) error {
		network, laddr, proto := "ip4:icmp", "0.0.0.0", 1
		var typ, reply icmp.Type = ipv4.ICMPTypeEcho, ipv4.ICMPTypeEchoReply
		if dst.Is6() {
			network, laddr, proto = "ip6:ipv6-icmp", "::", 58
			typ, reply = ipv6.ICMPTypeEchoRequest, ipv6.ICMPTypeEchoReply
		}
		c, err := icmp.ListenPacket(network, laddr)
		if err != nil {
			return fmt.Errorf("icmp socket: %w", err)
		}
		defer c.Close()
		id := os.Getpid() & 0xffff
		buf := make([]byte, 1500)
		var lastErr error
		for seq := 1; seq <= 3; seq++ {
			msg := icmp.Message{Type: typ, Body: &icmp.Echo{ID: id, Seq: seq, Data: []byte("kvipam-e2e")}}
			b, err := msg.Marshal(nil)
			if err != nil {
				return err
			}
			if _, err := c.WriteTo(b, &net.IPAddr{IP: dst.AsSlice()}); err != nil {
				lastErr = fmt.Errorf("send echo to %s: %w", dst, err)
				continue
			}
			deadline := time.Now().Add(time.Second)
			_ = c.SetReadDeadline(deadline)
			for {
				nr, peer, err := c.ReadFrom(buf)
				if err != nil {
					lastErr = fmt.Errorf("no echo reply from %s: %w", dst, err)
					break
				}
				m, err := icmp.ParseMessage(proto, buf[:nr])
				if err != nil || m.Type != reply {
					continue
				}
				if e, ok := m.Body.(*icmp.Echo); ok && e.ID == id && e.Seq == seq && peer.(*net.IPAddr).IP.Equal(dst.AsSlice()) {
					return nil
				}
			}
		}
		return lastErr
	})
}

func prettyJSON(v any) string {
	b, _ := json.MarshalIndent(v, "", "  ")
	return string(b)
}

func ipNet(p netip.Prefix) *net.IPNet {
	return &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
}

func readFile(path string) (string, error) {
	b, err := os.ReadFile(path)
	return string(b), err
}
