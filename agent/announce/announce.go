// Package announce tells the agent when a guest announces itself on a
// watched host veth: the end of a live migration, when the VM now runs in
// the target pod and says so with a gratuitous ARP, an unsolicited IPv6
// neighbor advertisement or a RARP frame (QEMU's announce_self). The agent
// moves the address's forwarding to the target on the first one.
//
// Two implementations of Watcher: PacketWatcher, an AF_PACKET socket per
// watched veth (the routes datapath), and BPFWatcher, which reads what the
// eBPF datapath's program reports (bpf.Datapath.Announcements). Both report
// the same announcements with the same fields.
package announce

import (
	"errors"
	"net"
	"net/netip"
)

// Kind is what announced the address.
type Kind string

// The kinds of announcement.
const (
	// GratuitousARP is an ARP request or reply whose sender and target
	// protocol addresses are both the announced address (arping -U, -A).
	GratuitousARP Kind = "garp"
	// NeighborAdvert is an unsolicited IPv6 neighbor advertisement (S flag
	// clear) whose target is the announced address.
	NeighborAdvert Kind = "na"
	// RARP is a RARP request or reply (ethertype 0x8035, op 3 or 4), what
	// QEMU's announce_self sends: no IP address, only the guest's MAC.
	RARP Kind = "rarp"
)

// Announcement is one guest announcement seen on a watched host veth.
type Announcement struct {
	HostIfIndex int
	HostIfName  string
	Kind        Kind
	// Addr is the announced address; invalid for RARP.
	Addr netip.Addr
	// MAC is the sender hardware address: the ARP or RARP sender's, the
	// Ethernet source of a neighbor advertisement.
	MAC net.HardwareAddr
}

// Watcher reports guest announcements on the host veths it is told to
// watch. Implementations are safe for concurrent use.
type Watcher interface {
	// Watch starts reporting announcements on the host veth hostIf (index
	// ifindex) for addrs (an ARP or NA for another address is not reported;
	// a RARP is, whatever it carries). Idempotent; a second call replaces
	// addrs.
	Watch(hostIf string, ifindex int, addrs []netip.Addr) error
	// Unwatch stops reporting on ifindex; unwatching what is not watched
	// succeeds. Nothing of ifindex is delivered after it returns.
	Unwatch(ifindex int) error
	// C delivers announcements. The watcher never blocks on it: an
	// announcement that finds it full is dropped and counted (Dropped).
	// It is closed by Close.
	C() <-chan Announcement
	// Dropped counts the announcements dropped because C was full.
	Dropped() uint64
	// Close stops watching everything and closes C. Idempotent.
	Close() error
}

// ErrClosed is returned by Watch and Unwatch after Close.
var ErrClosed = errors.New("announce: watcher closed")

// ErrInvalidWatch is returned by Watch for an interface or address that
// cannot be watched.
var ErrInvalidWatch = errors.New("announce: invalid watch")

// Buffer is the capacity of C: an announcement is rare (a few per
// migration), so a full channel means the consumer is stuck.
const Buffer = 256
