package e2e

import (
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/kvipam/kvipam/internal/testsupport/nstest"
)

// routeWatch follows, in each of a few namespaces, where the kernel
// sends some addresses: on every route change netlink reports in a
// namespace it asks the kernel again (ip route get) and records the
// answer when it changed, with the time the change was seen. It also
// records how many next hops the route to exactly each address (a /32
// or /128) has, from the changes themselves: two is ECMP, two nodes
// announcing one address at once.
type routeWatch struct {
	addrs []netip.Addr

	mu    sync.Mutex
	cond  *sync.Cond
	hops  [][]hopAt // by namespace, then in time order; each entry one address's
	paths []pathsAt // the exact routes' next hops, in time order
}

// hopAt is a namespace's hop for an address from a time on.
type hopAt struct {
	at   time.Time
	addr netip.Addr
	hop  hop
	err  error
}

// pathsAt is how many next hops a namespace's route to exactly addr
// has from a time on (0: none).
type pathsAt struct {
	at    time.Time
	ns    int
	addr  netip.Addr
	paths int
}

// watchRoutes starts watching addrs in namespaces until t ends.
func watchRoutes(t testing.TB, namespaces []ns.NetNS, addrs ...netip.Addr) *routeWatch {
	t.Helper()
	w := &routeWatch{addrs: addrs, hops: make([][]hopAt, len(namespaces))}
	w.cond = sync.NewCond(&w.mu)
	done := make(chan struct{})
	var wg sync.WaitGroup
	for i, n := range namespaces {
		nsh, err := netns.GetFromPath(n.Path())
		require.NoError(t, err)
		updates := make(chan netlink.RouteUpdate, 4096)
		require.NoError(t, netlink.RouteSubscribeWithOptions(updates, done, netlink.RouteSubscribeOptions{Namespace: &nsh,
			ErrorCallback: func(err error) {
				select {
				case <-done: // the subscription's end
				default:
					t.Logf("route subscription in namespace %d: %v", i, err)
				}
			}}))
		h := nstest.Handle(t, n)
		w.look(i, h, time.Now())
		wg.Go(func() {
			defer nsh.Close()
			for u := range updates {
				at := time.Now()
				w.exact(i, u, at)
				// Ask once for a burst of changes already queued.
				for more := true; more; {
					select {
					case u2, ok := <-updates:
						if !ok {
							more = false
							break
						}
						w.exact(i, u2, time.Now())
					default:
						more = false
					}
				}
				w.look(i, h, at)
			}
		})
	}
	t.Cleanup(func() { close(done); wg.Wait() })
	return w
}

// look asks the kernel of namespace i for its hop to each address.
func (w *routeWatch) look(i int, h *netlink.Handle, at time.Time) {
	for _, a := range w.addrs {
		got, err := routeTo(h, a)
		w.mu.Lock()
		if last, ok := w.lastLocked(i, a); !ok || last.hop != got || (last.err == nil) != (err == nil) {
			w.hops[i] = append(w.hops[i], hopAt{at: at, addr: a, hop: got, err: err})
			w.cond.Broadcast()
		}
		w.mu.Unlock()
	}
}

// exact records a change of the route to exactly one of the addresses.
func (w *routeWatch) exact(i int, u netlink.RouteUpdate, at time.Time) {
	if u.Dst == nil {
		return
	}
	p, ok := netip.AddrFromSlice(u.Dst.IP)
	ones, bits := u.Dst.Mask.Size()
	if !ok || ones != bits {
		return
	}
	p = p.Unmap()
	for _, a := range w.addrs {
		if a != p {
			continue
		}
		n := 0
		if u.Type == unix.RTM_NEWROUTE {
			n = max(len(u.MultiPath), 1)
		}
		w.mu.Lock()
		w.paths = append(w.paths, pathsAt{at: at, ns: i, addr: a, paths: n})
		w.mu.Unlock()
	}
}

func (w *routeWatch) lastLocked(i int, a netip.Addr) (hopAt, bool) {
	for j := len(w.hops[i]) - 1; j >= 0; j-- {
		if w.hops[i][j].addr == a {
			return w.hops[i][j], true
		}
	}
	return hopAt{}, false
}

// await waits until, in every namespace, the hop to a satisfies its
// predicate (by namespace), or the timeout passes (a test failure).
func (w *routeWatch) await(t testing.TB, timeout time.Duration, a netip.Addr, want []func(hop) bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	timer := time.AfterFunc(timeout, func() { w.mu.Lock(); w.cond.Broadcast(); w.mu.Unlock() })
	defer timer.Stop()
	w.mu.Lock()
	defer w.mu.Unlock()
	for {
		all := true
		var where []string
		for i := range w.hops {
			last, ok := w.lastLocked(i, a)
			if !ok || last.err != nil || !want[i](last.hop) {
				all = false
				where = append(where, last.hop.String())
			}
		}
		if all {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for every namespace's route to %s to move; still %v", timeout, a, where)
		}
		w.cond.Wait()
	}
}

// converged is how long after from every namespace's hop to a last
// became the one want accepts (0 for a namespace that had it already),
// the latest of them, and each namespace's.
func (w *routeWatch) converged(from time.Time, a netip.Addr, want []func(hop) bool) (time.Duration, []time.Duration) {
	w.mu.Lock()
	defer w.mu.Unlock()
	var worst time.Duration
	each := make([]time.Duration, len(w.hops))
	for i, hs := range w.hops {
		ok := false
		var since time.Time
		for _, h := range hs {
			if h.addr != a {
				continue
			}
			good := h.err == nil && want[i](h.hop)
			if good && !ok {
				since = h.at
			}
			ok = good
		}
		if ok && since.After(from) {
			each[i] = since.Sub(from)
			worst = max(worst, each[i])
		}
	}
	return worst, each
}

// longestOverlap is the longest time since from that namespace i's
// route to exactly a had more than one next hop.
func (w *routeWatch) longestOverlap(from time.Time, i int, a netip.Addr) time.Duration {
	w.mu.Lock()
	defer w.mu.Unlock()
	var longest time.Duration
	var began time.Time
	for _, p := range w.paths {
		if p.ns != i || p.addr != a || p.at.Before(from) {
			continue
		}
		switch {
		case p.paths > 1 && began.IsZero():
			began = p.at
		case p.paths <= 1 && !began.IsZero():
			longest, began = max(longest, p.at.Sub(began)), time.Time{}
		}
	}
	if !began.IsZero() {
		longest = max(longest, time.Since(began))
	}
	return longest
}

// changes counts the hops namespace i has had (a change of any
// address's hop adds one).
func (w *routeWatch) changes(i int) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.hops[i])
}

// maxPaths is the most next hops namespace i's route to exactly a had
// since from.
func (w *routeWatch) maxPaths(from time.Time, i int, a netip.Addr) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	n := 0
	for _, p := range w.paths {
		if p.ns == i && p.addr == a && !p.at.Before(from) {
			n = max(n, p.paths)
		}
	}
	return n
}
