package e2e

import (
	"fmt"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/kvipam/kvipam/internal/testsupport/nstest"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// nlWatch records every route and link change netlink reports in one
// namespace, so a test can assert that something it did (an agent
// restart) changed nothing in the kernel.
type nlWatch struct {
	mu     sync.Mutex
	events []nlEvent
}

type nlEvent struct {
	at   time.Time
	what string
}

func watchNetlink(t testing.TB, n ns.NetNS) *nlWatch {
	t.Helper()
	h, err := netns.GetFromPath(n.Path())
	require.NoError(t, err)
	t.Cleanup(func() { _ = h.Close() })
	w := &nlWatch{}
	// A link update that changes none of what a link is (the kernel
	// sends one on IPv6 autoconfiguration events, for instance) is not a
	// change; start from the links as they are.
	type linkState struct {
		name        string
		flags       net.Flags
		mtu, master int
		mac         string
	}
	stateOf := func(l netlink.Link) linkState {
		a := l.Attrs()
		// Not FlagRunning: the kernel updates the operational state
		// lazily (linkwatch), seconds after the carrier came.
		return linkState{a.Name, a.Flags &^ net.FlagRunning, a.MTU, a.MasterIndex, a.HardwareAddr.String()}
	}
	links0, err := nstest.Handle(t, n).LinkList()
	require.NoError(t, err)
	known := map[int]linkState{}
	for _, l := range links0 {
		known[l.Attrs().Index] = stateOf(l)
	}
	done := make(chan struct{})
	routes := make(chan netlink.RouteUpdate, 1024)
	links := make(chan netlink.LinkUpdate, 1024)
	fail := func(err error) { w.add("netlink subscription error: " + err.Error()) }
	require.NoError(t, netlink.RouteSubscribeWithOptions(routes, done, netlink.RouteSubscribeOptions{Namespace: &h, ErrorCallback: fail}))
	require.NoError(t, netlink.LinkSubscribeWithOptions(links, done, netlink.LinkSubscribeOptions{Namespace: &h, ErrorCallback: fail}))
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		for u := range routes {
			if u.Protocol == unix.RTPROT_KERNEL {
				// The kernel's own routes (local, link-local, multicast,
				// connected) follow address and link changes, which the
				// link watch reports; IPv6 adds some seconds after a link
				// comes up, when DAD completes: not anyone's doing.
				continue
			}
			op := map[uint16]string{unix.RTM_NEWROUTE: "add", unix.RTM_DELROUTE: "delete"}[u.Type]
			w.add(fmt.Sprintf("route %s %s via %s dev %d proto %d", op, u.Dst, u.Gw, u.LinkIndex, u.Protocol))
		}
	}()
	go func() {
		defer wg.Done()
		for u := range links {
			st, ok := known[u.Attrs().Index]
			if u.Header.Type == unix.RTM_NEWLINK && ok && st == stateOf(u.Link) {
				continue
			}
			known[u.Attrs().Index] = stateOf(u.Link)
			op := map[uint16]string{unix.RTM_NEWLINK: "new/change", unix.RTM_DELLINK: "delete"}[u.Header.Type]
			w.add(fmt.Sprintf("link %s %s index %d: %+v (was %+v)", op, u.Attrs().Name, u.Attrs().Index, stateOf(u.Link), st))
		}
	}()
	t.Cleanup(func() { close(done); wg.Wait() })
	return w
}

func (w *nlWatch) add(what string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.events = append(w.events, nlEvent{at: time.Now(), what: what})
}

// between lists the changes seen from from to to.
func (w *nlWatch) between(from, to time.Time) []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []string
	for _, e := range w.events {
		if !e.at.Before(from) && !e.at.After(to) {
			out = append(out, e.at.Format("15:04:05.000")+" "+e.what)
		}
	}
	return out
}
