package announce

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"sync"

	"github.com/hashicorp/go-hclog"
	"golang.org/x/sys/unix"
)

// PacketWatcher watches host veths with an AF_PACKET socket each, for the
// routes datapath (no eBPF program sees the pod's frames). A socket is
// bound to its veth, keeps only incoming ARP, RARP and neighbor
// advertisements (a classic BPF filter, filter.go), and has a goroutine
// that parses what arrives and reports it.
//
// It is safe for concurrent use: Watch, Unwatch and Close run one at a
// time (opening and closing sockets), reports go on meanwhile.
type PacketWatcher struct {
	netns string
	log   hclog.Logger
	rep   *reporter

	// opMu serializes Watch, Unwatch and Close; socks is written under it.
	opMu  sync.Mutex
	socks map[int]*packetSocket
}

var _ Watcher = (*PacketWatcher)(nil)

// NewPacketWatcher returns a watcher whose sockets are created in the
// network namespace at netnsPath, the one holding the host veths ("" is
// the caller's). A nil log discards messages.
func NewPacketWatcher(netnsPath string, log hclog.Logger) (*PacketWatcher, error) {
	if log == nil {
		log = hclog.NewNullLogger()
	}
	if netnsPath != "" {
		if _, err := os.Stat(netnsPath); err != nil {
			return nil, fmt.Errorf("network namespace of the host veths: %w", err)
		}
	}
	return &PacketWatcher{netns: netnsPath, log: log, rep: newReporter(log), socks: map[int]*packetSocket{}}, nil
}

// Watch opens the socket of hostIf, or replaces the addresses of one
// already open. It fails when ifindex does not name hostIf in the watcher's
// namespace.
func (w *PacketWatcher) Watch(hostIf string, ifindex int, addrs []netip.Addr) error {
	wa, err := checkWatch(hostIf, ifindex, addrs)
	if err != nil {
		return err
	}
	w.opMu.Lock()
	defer w.opMu.Unlock()
	if w.rep.isClosed() {
		return ErrClosed
	}
	if s, ok := w.socks[ifindex]; ok && s.name == hostIf {
		return w.rep.set(ifindex, wa)
	}
	if err := w.unwatch(ifindex); err != nil {
		return err
	}
	s, err := openPacketSocket(w.netns, hostIf, ifindex)
	if err != nil {
		return err
	}
	if err := w.rep.set(ifindex, wa); err != nil {
		return errors.Join(err, s.close())
	}
	w.socks[ifindex] = s
	go s.run(w.rep, w.log)
	w.log.Debug("watching for announcements", "host_if", hostIf, "ifindex", ifindex, "addrs", addrs)
	return nil
}

// Unwatch closes the socket of ifindex and waits for its goroutine.
func (w *PacketWatcher) Unwatch(ifindex int) error {
	w.opMu.Lock()
	defer w.opMu.Unlock()
	if w.rep.isClosed() {
		return ErrClosed
	}
	return w.unwatch(ifindex)
}

func (w *PacketWatcher) unwatch(ifindex int) error {
	w.rep.unset(ifindex)
	s, ok := w.socks[ifindex]
	if !ok {
		return nil
	}
	delete(w.socks, ifindex)
	if err := s.close(); err != nil {
		return fmt.Errorf("unwatch %s: %w", s.name, err)
	}
	return nil
}

// C delivers announcements; Close closes it.
func (w *PacketWatcher) C() <-chan Announcement { return w.rep.ch }

// Dropped counts announcements dropped because C was full.
func (w *PacketWatcher) Dropped() uint64 { return w.rep.dropped.Load() }

// Close closes every socket, waits for their goroutines and closes C.
func (w *PacketWatcher) Close() error {
	w.opMu.Lock()
	defer w.opMu.Unlock()
	var errs []error
	for ifindex := range w.socks {
		errs = append(errs, w.unwatch(ifindex))
	}
	w.rep.close()
	return errors.Join(errs...)
}

// packetSocket is the AF_PACKET socket of one host veth and its reader.
type packetSocket struct {
	name    string
	ifindex int
	f       *os.File // non-blocking: Close wakes a read in progress
	done    chan struct{}
}

// openPacketSocket creates the socket in netnsPath, bound to ifindex, after
// checking that ifindex is hostIf there.
func openPacketSocket(netnsPath, hostIf string, ifindex int) (*packetSocket, error) {
	filter, err := socketFilter()
	if err != nil {
		return nil, err
	}
	var fd int
	err = inNetns(netnsPath, func() error {
		if err := checkIfindex(hostIf, ifindex); err != nil {
			return err
		}
		// Protocol 0 receives nothing until bind, so no frame of
		// another interface, or one the filter would refuse, is queued
		// before the filter is on.
		fd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("open packet socket: %w", err)
		}
		if err := setup(fd, ifindex, filter); err != nil {
			unix.Close(fd)
			return err
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("watch %s (ifindex %d): %w", hostIf, ifindex, err)
	}
	return &packetSocket{
		name:    hostIf,
		ifindex: ifindex,
		f:       os.NewFile(uintptr(fd), "packet:"+hostIf),
		done:    make(chan struct{}),
	}, nil
}

func setup(fd, ifindex int, filter []unix.SockFilter) error {
	prog := unix.SockFprog{Len: uint16(len(filter)), Filter: &filter[0]}
	if err := unix.SetsockoptSockFprog(fd, unix.SOL_SOCKET, unix.SO_ATTACH_FILTER, &prog); err != nil {
		return fmt.Errorf("attach socket filter: %w", err)
	}
	sa := &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: ifindex}
	if err := unix.Bind(fd, sa); err != nil {
		return fmt.Errorf("bind packet socket: %w", err)
	}
	return nil
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

// run reads frames until the socket is closed and reports announcements.
func (s *packetSocket) run(rep *reporter, log hclog.Logger) {
	defer close(s.done)
	rc, err := s.f.SyscallConn()
	if err != nil {
		log.Error("announcement socket stopped", "host_if", s.name, "error", err)
		return
	}
	buf := make([]byte, snapLen)
	for {
		var (
			n    int
			from unix.Sockaddr
			rerr error
		)
		err := rc.Read(func(fd uintptr) bool {
			n, from, rerr = unix.Recvfrom(int(fd), buf, 0)
			return rerr != unix.EAGAIN && rerr != unix.EINTR
		})
		if err != nil {
			// The only errors of a read with no deadline: the socket
			// was closed (Unwatch, Close).
			return
		}
		if rerr != nil {
			// A socket error (ENETDOWN once when the veth goes) loses
			// frames, not the watch.
			log.Warn("reading announcement socket", "host_if", s.name, "error", rerr)
			continue
		}
		if ll, ok := from.(*unix.SockaddrLinklayer); ok && ll.Pkttype == unix.PACKET_OUTGOING {
			continue
		}
		if kind, addr, mac, ok := parseFrame(buf[:n]); ok {
			rep.report(s.ifindex, kind, addr, mac)
		}
	}
}

// close closes the socket and waits for its reader to end.
func (s *packetSocket) close() error {
	err := s.f.Close()
	<-s.done
	if err != nil {
		return fmt.Errorf("close packet socket: %w", err)
	}
	return nil
}
