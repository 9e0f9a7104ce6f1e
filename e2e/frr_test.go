package e2e

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// frr is FRR's zebra and bgpd (Debian's frr package) running in a router
// namespace a test made, with every file in a scratch directory: the
// top-of-rack router of the BGP tests.
type frr struct {
	t   testing.TB
	dir string
	ns  ns.NetNS
}

const frrLib = "/usr/lib/frr"

// startFRR starts zebra and bgpd with conf in rns; both are stopped by
// their pid files at cleanup.
func startFRR(t testing.TB, rns ns.NetNS, conf string) *frr {
	t.Helper()
	if _, err := os.Stat(filepath.Join(frrLib, "bgpd")); err != nil {
		t.Skip("FRR is not installed (apt-get install frr; .ci/run does)")
	}
	u, err := user.Lookup("frr")
	require.NoError(t, err, "the frr package's user")
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	dir, err := os.MkdirTemp("", "kv-frr-")
	require.NoError(t, err)
	f := &frr{t: t, dir: dir, ns: rns}
	t.Cleanup(func() {
		if t.Failed() {
			b, _ := os.ReadFile(filepath.Join(dir, "frr.log"))
			if len(b) > 6000 {
				b = b[len(b)-6000:]
			}
			t.Logf("FRR log tail:\n%s", b)
		}
		_ = os.RemoveAll(dir)
	})
	conf = fmt.Sprintf("log file %s/frr.log debugging\n", dir) + conf
	require.NoError(t, os.WriteFile(filepath.Join(dir, "frr.conf"), []byte(conf), 0o640))
	for _, p := range []string{dir, filepath.Join(dir, "frr.conf")} {
		require.NoError(t, os.Chown(p, uid, gid))
	}
	for _, d := range []string{"zebra", "bgpd"} {
		pid := filepath.Join(dir, d+".pid")
		args := []string{"--net=" + rns.Path(), filepath.Join(frrLib, d), "-d", "-f", filepath.Join(dir, "frr.conf"),
			"-z", filepath.Join(dir, "zserv.api"), "-i", pid, "--vty_socket", dir, "-u", "frr", "-g", "frr"}
		out, err := exec.Command("nsenter", args...).CombinedOutput()
		require.NoError(t, err, "start %s: %s", d, out)
		t.Cleanup(func() { stopByPidFile(pid) })
		waitFor(t, 20*time.Second, d+" to write its pid file", func() bool { _, err := os.Stat(pid); return err == nil })
		if d == "zebra" {
			waitFor(t, 20*time.Second, "zebra's zserv socket", func() bool {
				_, err := os.Stat(filepath.Join(dir, "zserv.api"))
				return err == nil
			})
		}
	}
	return f
}

func stopByPidFile(pidFile string) {
	b, err := os.ReadFile(pidFile)
	if err != nil {
		return
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 1 {
		return
	}
	_ = syscall.Kill(pid, syscall.SIGTERM)
	for range 50 {
		if syscall.Kill(pid, 0) != nil {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	_ = syscall.Kill(pid, syscall.SIGKILL)
}

// vtysh runs one vtysh command against this FRR.
func (f *frr) vtysh(cmd string) ([]byte, error) {
	return exec.Command("vtysh", "--vty_socket", f.dir, "-c", cmd).CombinedOutput()
}

// frrPath is one path of `show bgp ... json`.
type frrPath struct {
	Valid    bool   `json:"valid"`
	Best     bool   `json:"bestpath"`
	Stale    bool   `json:"stale"`
	PeerID   string `json:"peerId"`
	Nexthops []struct {
		IP string `json:"ip"`
	} `json:"nexthops"`
}

// routes are the prefixes FRR's BGP table holds for family (ipv4 or
// ipv6), each with its best path.
func (f *frr) routes(family string) map[netip.Prefix]frrPath {
	f.t.Helper()
	out, err := f.vtysh("show bgp " + family + " unicast json")
	require.NoError(f.t, err, "%s", out)
	var tbl struct {
		Routes map[string][]frrPath `json:"routes"`
	}
	require.NoError(f.t, json.Unmarshal(out, &tbl), "%s", out)
	res := map[netip.Prefix]frrPath{}
	for p, paths := range tbl.Routes {
		pfx, err := netip.ParsePrefix(p)
		require.NoError(f.t, err)
		for _, path := range paths {
			if path.Best || len(paths) == 1 {
				res[pfx] = path
			}
		}
	}
	return res
}

// nextHops are the prefixes of family with their best path's first next hop.
func (f *frr) nextHops(family string) map[netip.Prefix]netip.Addr {
	f.t.Helper()
	out := map[netip.Prefix]netip.Addr{}
	for p, path := range f.routes(family) {
		if len(path.Nexthops) > 0 {
			out[p] = netip.MustParseAddr(path.Nexthops[0].IP)
		}
	}
	return out
}

// frrNeighbor is FRR's view of one session.
type frrNeighbor struct {
	State       string `json:"bgpState"`
	Dropped     int    `json:"connectionsDropped"`
	ResetDueTo  string `json:"lastResetDueTo"`
	Established int    `json:"connectionsEstablished"`
}

func (f *frr) neighbor(peer netip.Addr) frrNeighbor {
	out, err := f.vtysh("show bgp neighbors " + peer.String() + " json")
	if err != nil {
		return frrNeighbor{}
	}
	var m map[string]frrNeighbor
	if json.Unmarshal(out, &m) != nil {
		return frrNeighbor{}
	}
	return m[peer.String()]
}

// established reports whether FRR's session with peer is established.
func (f *frr) established(peer netip.Addr) bool { return f.neighbor(peer).State == "Established" }

// frrPeer is a node the router peers with, and its TCP MD5 password.
type frrPeer struct {
	addr     netip.Addr
	password string
}

// frrConf is FRR's configuration as the top-of-rack router (AS 65000,
// 10.254.1.1) of nodes (AS 65001) that connect to it, IPv4 and IPv6 over
// each session; it sends the nodes nothing.
func frrConf(peers []frrPeer) string {
	var conf strings.Builder
	conf.WriteString("frr defaults datacenter\nhostname tor\n!\nrouter bgp 65000\n bgp router-id 10.254.1.1\n no bgp ebgp-requires-policy\n no bgp default ipv4-unicast\n")
	for _, p := range peers {
		fmt.Fprintf(&conf, " neighbor %s remote-as 65001\n neighbor %s passive\n", p.addr, p.addr)
		if p.password != "" {
			fmt.Fprintf(&conf, " neighbor %s password %s\n", p.addr, p.password)
		}
	}
	for _, fam := range []string{"ipv4", "ipv6"} {
		fmt.Fprintf(&conf, " address-family %s unicast\n", fam)
		for _, p := range peers {
			fmt.Fprintf(&conf, "  neighbor %s activate\n  neighbor %s route-map NODES-OUT out\n", p.addr, p.addr)
		}
		conf.WriteString(" exit-address-family\n")
	}
	conf.WriteString("!\nroute-map NODES-OUT deny 10\n!\n") // the nodes need no routes: send them none
	return conf.String()
}

// bgpNode is a node of the BGP fabric: its agent, CNI list, node
// addresses and pods.
type bgpNode struct {
	n      *node
	l      *libcni.NetworkConfigList
	v4, v6 netip.Addr
	gw4    netip.Addr // its rack's router address
	pods   []*pod
	ips    [][2]netip.Addr // each pod's IPv4 and IPv6 address
}

// bgpNodeSpec says where a node sits and how it peers.
type bgpNodeSpec struct {
	name     string
	rack     string // A or B
	host     int
	hold     time.Duration // the agent's proposed hold time (keepalive a third)
	password string        // TCP MD5, on both sides
	metrics  string        // the agent's --metrics-addr (in the node's namespace)
	// community is added to what the node sends this router (beside
	// every node's 65001:100).
	community string
	// passwordFile gives the agent the password in a file (with a
	// trailing newline, as a Secret created from a file has) instead of
	// inline.
	passwordFile bool
	// agentPassword, if set, is the agent's password instead of password
	// (FRR's): a mismatch.
	agentPassword string
	// asn is the node's AS, 65001 (what FRR expects) unless set.
	asn int
	// peers, if set, are the agent's peers instead of the rack's router.
	peers []map[string]any
	// down: the test expects the session not to come up, so the fabric
	// does not wait for it.
	down bool
	// logLevel is the agent's --log-level instead of debug.
	logLevel string
}

// bgpFabric is two racks (subnets A: 10.254.1.0/24, fd00:254:1::/64 and
// B: 10.254.2.0/24, fd00:254:2::/64) joined by one router namespace that
// runs FRR (AS 65000): the top-of-rack router of both. Every node (AS
// 65001) has only a default route to it, and FRR has no route to any pod
// prefix but what the nodes announce: pods on different nodes reach each
// other only through BGP. The first node's embedded etcd (on its rack
// address) is every agent's.
type bgpFabric struct {
	r     *router
	frr   *frr
	nodes []*bgpNode
}

const bgpPool = "default=10.9.0.0/26,fd00:9::/112"

func rackPrefix6(s string) string {
	if s == "A" {
		return "fd00:254:1::"
	}
	return "fd00:254:2::"
}

// enable6 gives the router fd00:254:1::1/64 on A and fd00:254:2::1/64
// on B, and IPv6 forwarding.
func (r *router) enable6(t testing.TB) {
	t.Helper()
	for _, s := range []string{"A", "B"} {
		br, err := r.h.LinkByName("br" + s)
		require.NoError(t, err)
		a := netip.MustParseAddr(rackPrefix6(s) + "1")
		require.NoError(t, r.h.AddrAdd(br, &netlink.Addr{IPNet: ipNet(netip.PrefixFrom(a, 64)), Flags: unix.IFA_F_NODAD}))
	}
	require.NoError(t, r.ns.Do(func(ns.NetNS) error {
		return os.WriteFile("/proc/sys/net/ipv6/conf/all/forwarding", []byte("1"), 0o644)
	}))
}

// attach6 gives node n (attached to subnet s) its IPv6 address on it and
// an IPv6 default route via the router; it returns the address.
func (r *router) attach6(t testing.TB, n *node, s string, host int) netip.Addr {
	t.Helper()
	a := netip.MustParseAddr(fmt.Sprintf("%s%d", rackPrefix6(s), host))
	h := nlHandle(t, n.host)
	ul, err := h.LinkByName("ul0")
	require.NoError(t, err)
	require.NoError(t, h.AddrAdd(ul, &netlink.Addr{IPNet: ipNet(netip.PrefixFrom(a, 64)), Flags: unix.IFA_F_NODAD}))
	require.NoError(t, h.RouteAdd(&netlink.Route{Gw: netip.MustParseAddr(rackPrefix6(s) + "1").AsSlice(), LinkIndex: ul.Attrs().Index}))
	return a
}

func newBGPFabric(t *testing.T, specs []bgpNodeSpec) *bgpFabric {
	t.Helper()
	f := &bgpFabric{r: newRouter(t)}
	f.r.enable6(t)
	var peers []frrPeer
	for _, s := range specs {
		peers = append(peers, frrPeer{addr: netip.MustParseAddr(fmt.Sprintf("%s.%d", subnetPrefix(s.rack), s.host)), password: s.password})
	}
	f.frr = startFRR(t, f.r.ns, frrConf(peers))

	var etcd string
	for i, s := range specs {
		n := newNode(t, s.name)
		b := &bgpNode{n: n, gw4: netip.MustParseAddr(subnetPrefix(s.rack) + ".1")}
		b.v4 = f.r.attach(t, n, s.rack, s.host)
		b.v6 = f.r.attach6(t, n, s.rack, s.host)

		hold := s.hold
		if hold == 0 {
			hold = 9 * time.Second
		}
		peer := map[string]any{"address": b.gw4.String(), "asn": 65000, "holdTime": hold.String(), "keepaliveTime": (hold / 3).String()}
		password := s.password
		if s.agentPassword != "" {
			password = s.agentPassword
		}
		switch {
		case password != "" && s.passwordFile:
			f := filepath.Join(n.dir, "bgp-password")
			require.NoError(t, os.WriteFile(f, []byte(password+"\n"), 0o600))
			peer["passwordFile"] = f
		case password != "":
			peer["password"] = password
		}
		if s.community != "" {
			peer["communities"] = []string{s.community}
		}
		peers := []map[string]any{peer}
		if s.peers != nil {
			peers = s.peers
		}
		asn := s.asn
		if asn == 0 {
			asn = 65001
		}
		cfg, err := json.Marshal(map[string]any{"bgp": map[string]any{"asn": asn, "peers": peers, "communities": []string{"65001:100"}}})
		require.NoError(t, err)
		cfgFile := filepath.Join(n.dir, "agent.yaml")
		require.NoError(t, os.WriteFile(cfgFile, cfg, 0o600))
		extra := []string{"--config", cfgFile, "--routing", "bgp", "--node-address", b.v4.String() + "," + b.v6.String()}
		if s.metrics != "" {
			extra = append(extra, "--metrics-addr", s.metrics)
		}
		if s.logLevel != "" {
			extra = append(extra, "--log-level", s.logLevel)
		}
		// The first node runs the embedded etcd (startAgent asks for it by
		// name) on its underlay address; the others use it.
		o := agentOpts{pools: []string{bgpPool}, blockV4: 27}
		if i == 0 {
			etcd = "http://" + b.v4.String() + ":2379"
			extra = append(extra, "--embedded-etcd-listen", etcd)
		} else {
			o.etcdURL = etcd
		}
		o.extra = extra
		n.startAgent(o)
		b.l = n.kvipamList("kv", "1.0.0", "")
		f.nodes = append(f.nodes, b)
	}
	for i, b := range f.nodes {
		if !specs[i].down {
			waitFor(t, 60*time.Second, "FRR's session with "+b.n.name, func() bool { return f.frr.established(b.v4) })
		}
	}
	return f
}

// addPod adds a dual-stack pod to b.
func (b *bgpNode) addPod(t *testing.T, name string) [2]netip.Addr {
	t.Helper()
	p := newPod(t, name)
	v4, v6 := podAddrs(t, b.n.mustAdd(b.l, p))
	require.True(t, v4.IsValid() && v6.IsValid(), "a dual-stack pod")
	b.pods, b.ips = append(b.pods, p), append(b.ips, [2]netip.Addr{v4, v6})
	return [2]netip.Addr{v4, v6}
}

// pingAll has every pod ping every other pod's addresses.
func (f *bgpFabric) pingAll(t *testing.T) {
	t.Helper()
	for _, from := range f.nodes {
		for _, p := range from.pods {
			for _, to := range f.nodes {
				for _, ips := range to.ips {
					for _, ip := range ips {
						require.NoError(t, ping(p.ns, ip), "%s on %s -> %s on %s", p.name, from.n.name, ip, to.n.name)
					}
				}
			}
		}
	}
}

// expected is what FRR's table of family should hold: each node's
// claimed blocks and borrowed addresses, with the node as next hop.
func (f *bgpFabric) expected(t *testing.T, family string) map[netip.Prefix]netip.Addr {
	t.Helper()
	want := map[netip.Prefix]netip.Addr{}
	for _, b := range f.nodes {
		nh := b.v4
		if family == "ipv6" {
			nh = b.v6
		}
		ps := b.n.poolStatus("default", family)
		for _, blk := range ps.Blocks {
			want[blk] = nh
		}
		for _, ips := range b.ips {
			ip := ips[0]
			if family == "ipv6" {
				ip = ips[1]
			}
			if !containsAny(ps.Blocks, ip) {
				want[netip.PrefixFrom(ip, ip.BitLen())] = nh // borrowed
			}
		}
	}
	return want
}

func containsAny(blocks []netip.Prefix, ip netip.Addr) bool {
	for _, b := range blocks {
		if b.Contains(ip) {
			return true
		}
	}
	return false
}

// waitTables waits until FRR's tables are exactly the expected ones.
func (f *bgpFabric) waitTables(t *testing.T) {
	t.Helper()
	for _, fam := range []string{"ipv4", "ipv6"} {
		want := f.expected(t, fam)
		var have map[netip.Prefix]netip.Addr
		waitFor(t, 30*time.Second, "FRR's "+fam+" table to hold exactly the nodes' homes", func() bool {
			have = f.frr.nextHops(fam)
			return mapsEqual(have, want)
		})
	}
}

func mapsEqual(a, b map[netip.Prefix]netip.Addr) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || w != v {
			return false
		}
	}
	return true
}

// routerRoute reports whether the router's kernel routes p, and whether
// by a route zebra installed from BGP.
func (f *bgpFabric) routerRoute(t *testing.T, p netip.Prefix) (ok, fromBGP bool) {
	t.Helper()
	fam := netlink.FAMILY_V4
	if p.Addr().Is6() {
		fam = netlink.FAMILY_V6
	}
	routes, err := f.r.h.RouteListFiltered(fam, &netlink.Route{Dst: ipNet(p)}, netlink.RT_FILTER_DST)
	require.NoError(t, err)
	for _, r := range routes {
		if r.Dst != nil && r.Dst.String() == p.String() {
			return true, r.Protocol == unix.RTPROT_BGP
		}
	}
	return false, false
}

// first is the time of the first change since from whose description
// contains what.
func (w *nlWatch) first(from time.Time, what string) (time.Time, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, e := range w.events {
		if !e.at.Before(from) && strings.Contains(e.what, what) {
			return e.at, true
		}
	}
	return time.Time{}, false
}

// scrape reads the agent's /metrics at addr in n's namespace.
func scrape(t *testing.T, n *node, addr string) string {
	t.Helper()
	var body []byte
	require.NoError(t, n.do(func() error {
		c, err := net.DialTimeout("tcp", addr, 5*time.Second)
		if err != nil {
			return err
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		if _, err := fmt.Fprintf(c, "GET /metrics HTTP/1.0\r\nHost: %s\r\n\r\n", addr); err != nil {
			return err
		}
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		body, err = io.ReadAll(resp.Body)
		return err
	}))
	return string(body)
}

// withCommunity are the prefixes of family whose best path carries
// community c.
func (f *frr) withCommunity(family, c string) []netip.Prefix {
	f.t.Helper()
	out, err := f.vtysh("show bgp " + family + " unicast community " + c + " json")
	require.NoError(f.t, err, "%s", out)
	var tbl struct {
		Routes map[string]json.RawMessage `json:"routes"`
	}
	require.NoError(f.t, json.Unmarshal(out, &tbl), "%s", out)
	var res []netip.Prefix
	for p := range tbl.Routes {
		res = append(res, netip.MustParsePrefix(p))
	}
	return res
}
