package k8s

import (
	"fmt"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// --- a netlink socket read by a goroutine: the proc connector's and
// taskstats' listeners ---

type nlListener struct {
	fd     int
	stop   chan struct{}
	closed chan struct{}
}

// openNetlink opens a netlink socket of protocol proto, bound to port pid
// (0: the kernel picks) and to the multicast groups.
func openNetlink(typ, proto int, pid, groups uint32) (*nlListener, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, typ|unix.SOCK_CLOEXEC, proto)
	if err != nil {
		return nil, fmt.Errorf("netlink socket (protocol %d): %w", proto, err)
	}
	// Bursts fork many processes at once: a large receive buffer, so that
	// the kernel drops no event while this process is descheduled.
	_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, 64<<20)
	// A netlink socket cannot be shut down: a read wakes up now and then
	// to see whether the listener was closed.
	tv := unix.NsecToTimeval(int64(200 * time.Millisecond))
	_ = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK, Groups: groups, Pid: pid}); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("netlink bind (protocol %d): %w", proto, err)
	}
	return &nlListener{fd: fd, stop: make(chan struct{}), closed: make(chan struct{})}, nil
}

// send sends one netlink message to the kernel.
func (l *nlListener) send(msg []byte) error {
	return unix.Sendto(l.fd, msg, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK})
}

// listen calls each, in a goroutine of its own, with every netlink message
// until close.
func (l *nlListener) listen(each func(syscall.NetlinkMessage)) {
	go func() {
		defer close(l.closed)
		buf := make([]byte, 1<<16)
		for {
			n, _, err := unix.Recvfrom(l.fd, buf, 0)
			switch {
			case err == unix.EINTR || err == unix.EAGAIN:
				select {
				case <-l.stop:
					return
				default:
					continue
				}
			case err == unix.ENOBUFS:
				continue // messages were dropped; the rest still count
			case err != nil || n == 0:
				return
			}
			msgs, err := syscall.ParseNetlinkMessage(buf[:n])
			if err != nil {
				continue
			}
			for _, m := range msgs {
				each(m)
			}
		}
	}()
}

// close stops the listening goroutine and closes the socket.
func (l *nlListener) close() {
	close(l.stop)
	<-l.closed
	unix.Close(l.fd)
}

// discard closes a socket that is not listened to.
func (l *nlListener) discard() { unix.Close(l.fd) }
