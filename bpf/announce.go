//go:build linux

package bpf

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"sync"

	"github.com/cilium/ebpf/ringbuf"
)

// AnnounceKind is what a guest announced itself with (announce_event.kind
// in kvipam.c).
type AnnounceKind uint8

// The kinds of announcement the program reports.
const (
	// AnnounceGARP is a gratuitous ARP request or reply: its sender and
	// target protocol addresses are the announced address.
	AnnounceGARP AnnounceKind = 1
	// AnnounceNA is an unsolicited IPv6 neighbor advertisement (S flag
	// clear) whose target is the announced address.
	AnnounceNA AnnounceKind = 2
	// AnnounceRARP is a RARP frame (QEMU's announce_self): no address,
	// only the guest's MAC.
	AnnounceRARP AnnounceKind = 3
)

// Announcement is one guest announcement the program saw on a watched host
// veth. Only announcements whose address passed the anti-spoofing check are
// reported (a RARP frame carries none and always passes).
type Announcement struct {
	HostIfIndex int
	Kind        AnnounceKind
	// Addr is the announced address; invalid for RARP.
	Addr netip.Addr
	// MAC is the sender hardware address: the ARP or RARP sender's, the
	// Ethernet source of a neighbor advertisement.
	MAC net.HardwareAddr
}

// announceEventSize is sizeof(struct announce_event) in kvipam.c.
const announceEventSize = 32

// WatchAnnouncements makes the program report announcements seen on the
// host veth ifindex (an entry in kvipam_watch). It is idempotent. The
// entry goes with the endpoint's other entries (Detach, Disarm, Adopt of a
// gone interface), so an ifindex reused by a later endpoint is not watched.
func (d *Datapath) WatchAnnouncements(ifindex int) error {
	unlock, err := d.lockEndpoint(ifindex)
	if err != nil {
		return err
	}
	defer unlock()
	return d.withMaps(func() error {
		if err := d.objs.KvipamWatch.Put(uint32(ifindex), uint32(1)); err != nil {
			return fmt.Errorf("watch announcements on ifindex %d: %w", ifindex, err)
		}
		return nil
	})
}

// UnwatchAnnouncements stops reporting announcements on ifindex;
// unwatching what is not watched succeeds.
func (d *Datapath) UnwatchAnnouncements(ifindex int) error {
	unlock, err := d.lockEndpoint(ifindex)
	if err != nil {
		return err
	}
	defer unlock()
	return d.withMaps(func() error {
		if err := deleteIfPresent(d.objs.KvipamWatch, uint32(ifindex)); err != nil {
			return fmt.Errorf("unwatch announcements on ifindex %d: %w", ifindex, err)
		}
		return nil
	})
}

// dropStaleWatches removes the announcement watches of interfaces that are
// not among kept, for Adopt (mu held exclusively).
func (d *Datapath) dropStaleWatches(kept []Endpoint) error {
	live := make(map[uint32]bool, len(kept))
	for _, ep := range kept {
		live[uint32(ep.HostIfIndex)] = true
	}
	var (
		ifindex, flags uint32
		stale          []uint32
	)
	it := d.objs.KvipamWatch.Iterate()
	for it.Next(&ifindex, &flags) {
		if !live[ifindex] {
			stale = append(stale, ifindex)
		}
	}
	if err := it.Err(); err != nil {
		return fmt.Errorf("iterate announcement watches: %w", err)
	}
	var errs []error
	for _, i := range stale {
		if err := deleteIfPresent(d.objs.KvipamWatch, i); err != nil {
			errs = append(errs, fmt.Errorf("delete announcement watch %d: %w", i, err))
		}
	}
	return errors.Join(errs...)
}

// AnnouncementReader reads the kvipam_announce ring buffer. Read and Close
// may be called from different goroutines; Read itself is for one
// goroutine at a time.
type AnnouncementReader struct {
	d *Datapath
	r *ringbuf.Reader
}

// Announcements opens the reader of the announcement ring buffer. There is
// one at a time per Datapath (readers would share the buffer's consumer
// position): ErrReaderOpen while another is open. The Datapath's Close
// closes it too, ending a Read in progress.
//
// The ring buffer is pinned, so events the program wrote while no agent
// ran are read first.
func (d *Datapath) Announcements() (*AnnouncementReader, error) {
	if err := d.lock(); err != nil {
		return nil, err
	}
	defer d.mu.Unlock()
	d.readerMu.Lock()
	defer d.readerMu.Unlock()
	if d.reader != nil {
		return nil, ErrReaderOpen
	}
	r, err := ringbuf.NewReader(d.objs.KvipamAnnounce)
	if err != nil {
		return nil, fmt.Errorf("open announcement ring buffer: %w", err)
	}
	d.reader = &AnnouncementReader{d: d, r: r}
	return d.reader, nil
}

// Read waits for the next announcement. After Close, of the reader or of
// the Datapath, it returns ErrClosed.
func (r *AnnouncementReader) Read() (Announcement, error) {
	for {
		rec, err := r.r.Read()
		if errors.Is(err, os.ErrClosed) {
			return Announcement{}, ErrClosed
		}
		if err != nil {
			return Announcement{}, fmt.Errorf("read announcement ring buffer: %w", err)
		}
		a, err := parseAnnouncement(rec.RawSample)
		if err != nil {
			// A record of another layout cannot come from this program's
			// map; skip it rather than stop reporting.
			r.d.log.Warn("skipping announcement record", "error", err)
			continue
		}
		return a, nil
	}
}

// Close ends a Read in progress and frees the reader; closing twice
// succeeds.
func (r *AnnouncementReader) Close() error {
	r.d.readerMu.Lock()
	defer r.d.readerMu.Unlock()
	return r.closeLocked()
}

func (r *AnnouncementReader) closeLocked() error {
	if r.d.reader == r {
		r.d.reader = nil
	}
	if err := r.r.Close(); err != nil && !errors.Is(err, os.ErrClosed) {
		return fmt.Errorf("close announcement ring buffer: %w", err)
	}
	return nil
}

// closeReader closes the open reader, if any, for Datapath.Close.
func (d *Datapath) closeReader() error {
	d.readerMu.Lock()
	defer d.readerMu.Unlock()
	if d.reader == nil {
		return nil
	}
	return d.reader.closeLocked()
}

// parseAnnouncement decodes a struct announce_event.
func parseAnnouncement(b []byte) (Announcement, error) {
	if len(b) < announceEventSize {
		return Announcement{}, fmt.Errorf("announcement record of %d bytes, want %d", len(b), announceEventSize)
	}
	a := Announcement{
		HostIfIndex: int(binary.NativeEndian.Uint32(b[0:4])),
		Kind:        AnnounceKind(b[4]),
		MAC:         net.HardwareAddr(append([]byte(nil), b[24:30]...)),
	}
	switch family := b[5]; {
	case a.Kind == AnnounceRARP && family == 0:
	case a.Kind == AnnounceGARP && family == familyIPv4:
		a.Addr = netip.AddrFrom4([4]byte(b[8:12]))
	case a.Kind == AnnounceNA && family == familyIPv6:
		a.Addr = netip.AddrFrom16([16]byte(b[8:24]))
	default:
		return Announcement{}, fmt.Errorf("announcement of kind %d with address family %d", a.Kind, family)
	}
	return a, nil
}

// readerState is the Datapath's open announcement reader.
type readerState struct {
	readerMu sync.Mutex
	reader   *AnnouncementReader
}
