package announce_test

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"github.com/kvipam/kvipam/agent/announce"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/hashicorp/go-hclog"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/kvipam/kvipam/bpf"
	"github.com/kvipam/kvipam/internal/testsupport/guestannounce"
	"github.com/kvipam/kvipam/internal/testsupport/nstest"
)

// Each test builds a scratch "host" network namespace and pods in their
// own namespaces behind veth pairs, as the CNI plugin does; the watcher
// watches the host ends. Nothing touches the real host's namespace.

// guard bounds a wait for something that must happen: it turns a hang into
// a failure and is never waited out on success.
const guard = 30 * time.Second

// pod is a pod namespace with eth0, whose peer is hostIf in the host.
type pod struct {
	ns      ns.NetNS
	mac     net.HardwareAddr
	hostIf  string
	ifindex int
	// v4 and v6 are watched; other4 and other6 are the pod's too (the
	// eBPF program lets them through) but not watched.
	v4, v6, other4, other6 netip.Addr
	// sender plays the guest on eth0.
	sender *guestannounce.Sender
}

// env is the host namespace, two pods, and the watcher under test.
type env struct {
	host   ns.NetNS
	p1, p2 *pod
	w      announce.Watcher
}

// impl is one announce.Watcher implementation, set up over an env's host namespace.
type impl struct {
	name string
	new  func(tb testing.TB, e *env) announce.Watcher
}

var impls = []impl{
	{name: "packet", new: func(tb testing.TB, e *env) announce.Watcher {
		w, err := announce.NewPacketWatcher(e.host.Path(), testLog(tb))
		require.NoError(tb, err)
		return w
	}},
	{name: "bpf", new: func(tb testing.TB, e *env) announce.Watcher {
		requireDatapath(tb)
		dp, err := bpf.Open(pinDir(tb), testLog(tb).Named("bpf"))
		require.NoError(tb, err)
		tb.Cleanup(func() { _ = dp.Close() })
		for i, p := range []*pod{e.p1, e.p2} {
			ep := bpf.Endpoint{ID: uint32(100 + i), HostIfIndex: p.ifindex, HostIfName: p.hostIf, MAC: p.mac,
				IPs: []netip.Addr{p.v4, p.v6, p.other4, p.other6}}
			require.NoError(tb, e.host.Do(func(ns.NetNS) error { return dp.Attach(ep) }))
		}
		w, err := announce.NewBPFWatcher(dp, testLog(tb))
		require.NoError(tb, err)
		return w
	}},
}

// newEnv builds the namespaces and the watcher of im, closed at cleanup.
func newEnv(tb testing.TB, im impl) *env {
	tb.Helper()
	nstest.RequireRoot(tb)
	e := &env{host: nstest.NewNS(tb)}
	e.p1 = addPod(tb, e.host, 1)
	e.p2 = addPod(tb, e.host, 2)
	e.w = im.new(tb, e)
	tb.Cleanup(func() { require.NoError(tb, e.w.Close()) })
	return e
}

func addPod(tb testing.TB, host ns.NetNS, i int) *pod {
	tb.Helper()
	pn := nstest.NewNS(tb)
	hh, ph := nstest.Handle(tb, host), nstest.Handle(tb, pn)
	p := &pod{ns: pn, hostIf: fmt.Sprintf("kvh%d", i),
		v4:     netip.MustParseAddr(fmt.Sprintf("10.244.0.%d", 10+i)),
		other4: netip.MustParseAddr(fmt.Sprintf("10.244.0.%d", 20+i)),
		v6:     netip.MustParseAddr(fmt.Sprintf("fd00:244::%d", 10+i)),
		other6: netip.MustParseAddr(fmt.Sprintf("fd00:244::%d", 20+i)),
	}
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: p.hostIf}, PeerName: "eth0",
		PeerNamespace: netlink.NsFd(int(pn.Fd()))}
	require.NoError(tb, hh.LinkAdd(veth))
	hl, err := hh.LinkByName(p.hostIf)
	require.NoError(tb, err)
	require.NoError(tb, hh.LinkSetUp(hl))
	p.ifindex = hl.Attrs().Index
	pl, err := ph.LinkByName("eth0")
	require.NoError(tb, err)
	require.NoError(tb, ph.LinkSetUp(pl))
	p.mac = pl.Attrs().HardwareAddr
	p.sender, err = guestannounce.NewSender(pn.Path(), "eth0")
	require.NoError(tb, err)
	tb.Cleanup(func() { _ = p.sender.Close() })
	return p
}

// send plays the guest: one announcement of kind for addr from p.
func (p *pod) send(tb testing.TB, kind announce.Kind, addr netip.Addr, mac net.HardwareAddr) {
	tb.Helper()
	require.NoError(tb, p.sender.Send(kind, addr, mac))
}

func (p *pod) sendFrame(tb testing.TB, frame []byte) {
	tb.Helper()
	require.NoError(tb, p.sender.SendFrame(frame))
}

func (p *pod) watch(tb testing.TB, w announce.Watcher) {
	tb.Helper()
	require.NoError(tb, w.Watch(p.hostIf, p.ifindex, []netip.Addr{p.v4, p.v6}))
}

// next awaits the next announcement on w.
func next(tb testing.TB, w announce.Watcher) announce.Announcement {
	tb.Helper()
	select {
	case a, ok := <-w.C():
		require.True(tb, ok, "C closed")
		return a
	case <-time.After(guard):
		tb.Fatal("no announcement reported")
		return announce.Announcement{}
	}
}

// marker sends a announce.RARP with a fresh MAC from the watched p and checks it is
// the next thing reported: whatever was sent before it was not reported.
func marker(tb testing.TB, w announce.Watcher, p *pod) {
	tb.Helper()
	mac := randomMAC(tb)
	p.send(tb, announce.RARP, netip.Addr{}, mac)
	require.Equal(tb, announce.Announcement{HostIfIndex: p.ifindex, HostIfName: p.hostIf, Kind: announce.RARP, MAC: mac}, next(tb, w),
		"the marker is the first thing reported after the frames before it")
}

func randomMAC(tb testing.TB) net.HardwareAddr {
	tb.Helper()
	m := make(net.HardwareAddr, 6)
	_, err := rand.Read(m)
	require.NoError(tb, err)
	m[0] = m[0]&^1 | 2 // unicast, locally administered
	return m
}

// requireDatapath skips when this kernel cannot run the eBPF datapath,
// found out by trying.
var supported = sync.OnceValue(bpf.Supported)

func requireDatapath(tb testing.TB) {
	tb.Helper()
	nstest.RequireRoot(tb)
	if err := supported(); err != nil {
		tb.Skipf("kernel cannot run the eBPF datapath: %v", err)
	}
}

// pinDir is a fresh directory on bpffs, removed (unpinning everything) at
// the end of the test.
func pinDir(tb testing.TB) string {
	tb.Helper()
	var st unix.Statfs_t
	require.NoError(tb, unix.Statfs("/sys/fs/bpf", &st))
	if uint32(st.Type) != unix.BPF_FS_MAGIC {
		require.NoError(tb, unix.Mount("bpf", "/sys/fs/bpf", "bpf", 0, "mode=0700"))
	}
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	dir := filepath.Join("/sys/fs/bpf", "kvipam-test-announce-"+hex.EncodeToString(b))
	tb.Cleanup(func() { _ = os.RemoveAll(dir) })
	return dir
}

func testLog(tb testing.TB) hclog.Logger {
	return hclog.New(&hclog.LoggerOptions{Name: "announce", Level: hclog.Info, Output: logWriter{tb}})
}

type logWriter struct{ tb testing.TB }

func (w logWriter) Write(p []byte) (int, error) {
	w.tb.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}
