package announce

import (
	"fmt"
	"net"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/hashicorp/go-hclog"
)

// reporter is what both watchers share: the watched interfaces and their
// addresses, the filter on them, and the non-blocking delivery on C.
//
// It is safe for concurrent use. report holds mu while it looks the
// interface up and sends (a send never blocks), so once unwatch returns
// nothing of that interface is delivered; close closes C under mu, so no
// report sends after.
type reporter struct {
	log     hclog.Logger
	dropped atomic.Uint64

	mu      sync.Mutex
	watches map[int]watch
	ch      chan Announcement
	closed  bool
}

// watch is one watched host veth.
type watch struct {
	name  string
	addrs map[netip.Addr]bool
}

func newReporter(log hclog.Logger) *reporter {
	if log == nil {
		log = hclog.NewNullLogger()
	}
	return &reporter{log: log, watches: map[int]watch{}, ch: make(chan Announcement, Buffer)}
}

// checkWatch validates Watch's arguments and returns the watch they make.
func checkWatch(hostIf string, ifindex int, addrs []netip.Addr) (watch, error) {
	if ifindex <= 0 {
		return watch{}, fmt.Errorf("%w: host ifindex %d", ErrInvalidWatch, ifindex)
	}
	if hostIf == "" {
		return watch{}, fmt.Errorf("%w: no host interface name for ifindex %d", ErrInvalidWatch, ifindex)
	}
	w := watch{name: hostIf, addrs: make(map[netip.Addr]bool, len(addrs))}
	for _, a := range addrs {
		a = a.Unmap().WithZone("")
		if !a.IsValid() || a.IsUnspecified() || a.IsMulticast() {
			return watch{}, fmt.Errorf("%w: address %s cannot be announced", ErrInvalidWatch, a)
		}
		w.addrs[a] = true
	}
	return w, nil
}

// set sets or replaces the watch of ifindex. It fails after close.
func (r *reporter) set(ifindex int, w watch) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return ErrClosed
	}
	r.watches[ifindex] = w
	return nil
}

// has reports whether ifindex is watched.
func (r *reporter) has(ifindex int) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	_, ok := r.watches[ifindex]
	return ok
}

// watched lists the watched interfaces.
func (r *reporter) watched() []int {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]int, 0, len(r.watches))
	for ifindex := range r.watches {
		out = append(out, ifindex)
	}
	return out
}

// unset stops reporting ifindex.
func (r *reporter) unset(ifindex int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.watches, ifindex)
}

// isClosed reports whether close was called.
func (r *reporter) isClosed() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.closed
}

// report delivers an announcement seen on ifindex if ifindex is watched
// and, for ARP and NA, addr is one of its addresses.
func (r *reporter) report(ifindex int, kind Kind, addr netip.Addr, mac net.HardwareAddr) {
	r.mu.Lock()
	defer r.mu.Unlock()
	w, ok := r.watches[ifindex]
	if !ok || r.closed {
		return
	}
	if kind != RARP && !w.addrs[addr] {
		return
	}
	a := Announcement{HostIfIndex: ifindex, HostIfName: w.name, Kind: kind, Addr: addr, MAC: slices.Clone(mac)}
	select {
	case r.ch <- a:
		r.log.Debug("guest announcement", "host_if", w.name, "kind", kind, "addr", addr, "mac", mac)
	default:
		n := r.dropped.Add(1)
		r.log.Warn("announcement dropped: channel full", "host_if", w.name, "kind", kind, "addr", addr, "dropped", n)
	}
}

// close forgets every watch and closes C; it reports whether this call
// closed it.
func (r *reporter) close() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return false
	}
	r.closed = true
	r.watches = map[int]watch{}
	close(r.ch)
	return true
}
