package announce

import (
	"errors"
	"fmt"
	"net/netip"
	"sync"

	"github.com/hashicorp/go-hclog"

	"github.com/kvipam/kvipam/bpf"
)

// BPFWatcher watches host veths through the eBPF datapath: the endpoint's
// program already sees every frame the pod sends, and on a watched
// interface reports announcements whose address passed its anti-spoofing
// check in a ring buffer (bpf.Datapath.Announcements). A goroutine reads
// the ring buffer and reports what passes the addresses filter.
//
// The program reports only on interfaces it is attached to, so Watch an
// endpoint after the datapath has set it up. It is safe for concurrent use.
type BPFWatcher struct {
	dp   *bpf.Datapath
	log  hclog.Logger
	rep  *reporter
	r    *bpf.AnnouncementReader
	done chan struct{}

	// opMu serializes Watch, Unwatch and Close, so the kernel's watch map
	// and the reporter's watches change together.
	opMu sync.Mutex
}

var _ Watcher = (*BPFWatcher)(nil)

// NewBPFWatcher opens dp's announcement reader and starts reading it.
// Close closes the reader, not dp; closing dp first ends the reading too.
// A nil log discards messages.
//
// The ring buffer is pinned: events the program wrote while no agent ran
// are read at once, and reported if their interface is watched by then.
func NewBPFWatcher(dp *bpf.Datapath, log hclog.Logger) (*BPFWatcher, error) {
	if log == nil {
		log = hclog.NewNullLogger()
	}
	r, err := dp.Announcements()
	if err != nil {
		return nil, fmt.Errorf("announcement watcher: %w", err)
	}
	w := &BPFWatcher{dp: dp, log: log, rep: newReporter(log), r: r, done: make(chan struct{})}
	go w.run()
	return w, nil
}

var kinds = map[bpf.AnnounceKind]Kind{
	bpf.AnnounceGARP: GratuitousARP,
	bpf.AnnounceNA:   NeighborAdvert,
	bpf.AnnounceRARP: RARP,
}

func (w *BPFWatcher) run() {
	defer close(w.done)
	for {
		a, err := w.r.Read()
		if errors.Is(err, bpf.ErrClosed) {
			return
		}
		if err != nil {
			w.log.Error("announcement reader stopped", "error", err)
			return
		}
		kind, ok := kinds[a.Kind]
		if !ok {
			w.log.Warn("skipping announcement of an unknown kind", "kind", a.Kind, "ifindex", a.HostIfIndex)
			continue
		}
		w.rep.report(a.HostIfIndex, kind, a.Addr, a.MAC)
	}
}

// Watch makes the program report on ifindex and sets its addresses.
func (w *BPFWatcher) Watch(hostIf string, ifindex int, addrs []netip.Addr) error {
	wa, err := checkWatch(hostIf, ifindex, addrs)
	if err != nil {
		return err
	}
	w.opMu.Lock()
	defer w.opMu.Unlock()
	if w.rep.isClosed() {
		return ErrClosed
	}
	if err := w.dp.WatchAnnouncements(ifindex); err != nil {
		return fmt.Errorf("watch %s: %w", hostIf, err)
	}
	if err := w.rep.set(ifindex, wa); err != nil {
		return err
	}
	w.log.Debug("watching for announcements", "host_if", hostIf, "ifindex", ifindex, "addrs", addrs)
	return nil
}

// Unwatch stops reporting ifindex, then removes its entry in the kernel.
func (w *BPFWatcher) Unwatch(ifindex int) error {
	w.opMu.Lock()
	defer w.opMu.Unlock()
	if w.rep.isClosed() {
		return ErrClosed
	}
	if !w.rep.has(ifindex) {
		return nil
	}
	w.rep.unset(ifindex)
	if err := w.dp.UnwatchAnnouncements(ifindex); err != nil {
		return fmt.Errorf("unwatch ifindex %d: %w", ifindex, err)
	}
	return nil
}

// C delivers announcements; Close closes it.
func (w *BPFWatcher) C() <-chan Announcement { return w.rep.ch }

// Dropped counts announcements dropped because C was full.
func (w *BPFWatcher) Dropped() uint64 { return w.rep.dropped.Load() }

// Close removes the kernel's watch entries of the interfaces it watches
// (when dp is still open), closes the reader, waits for its goroutine and
// closes C.
func (w *BPFWatcher) Close() error {
	w.opMu.Lock()
	defer w.opMu.Unlock()
	if w.rep.isClosed() {
		return nil
	}
	var errs []error
	for _, ifindex := range w.rep.watched() {
		if err := w.dp.UnwatchAnnouncements(ifindex); err != nil && !errors.Is(err, bpf.ErrClosed) {
			errs = append(errs, fmt.Errorf("unwatch ifindex %d: %w", ifindex, err))
		}
	}
	w.rep.close()
	if err := w.r.Close(); err != nil {
		errs = append(errs, err)
	}
	<-w.done
	return errors.Join(errs...)
}
