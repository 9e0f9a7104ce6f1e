package bgp

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strconv"
	"syscall"
	"time"

	"github.com/osrg/gobgp/v3/pkg/packet/bgp"
	"golang.org/x/sys/unix"
)

// probeTimeout bounds one probe: connect, OPEN, and the router's answer.
const probeTimeout = 5 * time.Second

// openProbe is what a probe connection needs to look to the router like
// the session's own: the router's address and port, the TCP MD5 password,
// the TTL (1 for eBGP unless multihop, the default for iBGP), and the
// OPEN's AS, hold time and BGP identifier.
type openProbe struct {
	addr     netip.Addr
	port     uint32
	password string
	ttl      int
	localAS  uint32
	hold     time.Duration
	routerID netip.Addr
}

// errProbeAccepted says the router accepted the probe's OPEN: what ends
// the session's OPEN exchange is not the OPEN itself.
var errProbeAccepted = errors.New("bgp: the router accepted the probe's OPEN")

// notificationAnswer is the NOTIFICATION the router answered a probe's
// OPEN with.
type notificationAnswer struct {
	code, subcode uint8
	data          []byte
}

// run connects to the router as the session does, sends an OPEN like the
// session's (its AS, hold time and identifier, IPv4 and IPv6 unicast,
// route refresh, 4-octet AS), and returns the NOTIFICATION the router
// answers with. GoBGP v3 reads but does not decode a NOTIFICATION that
// comes before a session is established: it reports only "invalid-msg",
// while the router knows, and says, why it refused the OPEN (OPEN Message
// Error / Bad Peer AS). The probe never establishes a session: if the
// router answers with its KEEPALIVE, the probe sends Cease /
// Administrative Reset and returns errProbeAccepted.
func (p openProbe) run(ctx context.Context) (notificationAnswer, error) {
	ctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	d := net.Dialer{Control: p.control}
	conn, err := d.DialContext(ctx, "tcp", net.JoinHostPort(p.addr.String(), strconv.Itoa(int(p.port))))
	if err != nil {
		return notificationAnswer{}, fmt.Errorf("bgp: probe: %w", err)
	}
	defer conn.Close()
	deadline, _ := ctx.Deadline()
	_ = conn.SetDeadline(deadline)
	if err := write(conn, p.open()); err != nil {
		return notificationAnswer{}, fmt.Errorf("bgp: probe: send OPEN: %w", err)
	}
	for {
		m, err := read(conn)
		if err != nil {
			return notificationAnswer{}, fmt.Errorf("bgp: probe: read the router's answer: %w", err)
		}
		switch body := m.Body.(type) {
		case *bgp.BGPNotification:
			return notificationAnswer{code: body.ErrorCode, subcode: body.ErrorSubcode, data: body.Data}, nil
		case *bgp.BGPOpen:
			continue // the router's own OPEN; its verdict on ours follows
		case *bgp.BGPKeepAlive:
			_ = write(conn, bgp.NewBGPNotificationMessage(bgp.BGP_ERROR_CEASE, bgp.BGP_ERROR_SUB_ADMINISTRATIVE_RESET, nil))
			return notificationAnswer{}, errProbeAccepted
		default:
			return notificationAnswer{}, fmt.Errorf("bgp: probe: unexpected message type %d", m.Header.Type)
		}
	}
}

// open is the probe's OPEN.
func (p openProbe) open() *bgp.BGPMessage {
	as2 := uint16(bgp.AS_TRANS)
	if p.localAS <= 65535 {
		as2 = uint16(p.localAS)
	}
	caps := []bgp.ParameterCapabilityInterface{
		bgp.NewCapMultiProtocol(bgp.RF_IPv4_UC), bgp.NewCapMultiProtocol(bgp.RF_IPv6_UC),
		bgp.NewCapRouteRefresh(), bgp.NewCapFourOctetASNumber(p.localAS),
	}
	return bgp.NewBGPOpenMessage(as2, uint16(p.hold.Seconds()), p.routerID.String(),
		[]bgp.OptionParameterInterface{bgp.NewOptionParameterCapability(caps)})
}

// control sets the session's TCP MD5 password and TTL on the probe's
// socket before it connects.
func (p openProbe) control(_, _ string, c syscall.RawConn) error {
	var serr error
	err := c.Control(func(fd uintptr) {
		if p.password != "" {
			sig := unix.TCPMD5Sig{Keylen: uint16(len(p.password))}
			copy(sig.Key[:], p.password)
			if p.addr.Is4() {
				sig.Addr.Family = unix.AF_INET
				a := p.addr.As4()
				copy(sig.Addr.Data[2:], a[:])
			} else {
				sig.Addr.Family = unix.AF_INET6
				a := p.addr.As16()
				copy(sig.Addr.Data[6:], a[:])
			}
			if serr = unix.SetsockoptTCPMD5Sig(int(fd), unix.IPPROTO_TCP, unix.TCP_MD5SIG, &sig); serr != nil {
				serr = fmt.Errorf("set TCP MD5 password: %w", serr)
				return
			}
		}
		if p.ttl > 0 {
			if p.addr.Is4() {
				serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_IP, unix.IP_TTL, p.ttl)
			} else {
				serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_IPV6, unix.IPV6_UNICAST_HOPS, p.ttl)
			}
			if serr != nil {
				serr = fmt.Errorf("set TTL: %w", serr)
			}
		}
	})
	return errors.Join(err, serr)
}

func write(w io.Writer, m *bgp.BGPMessage) error {
	b, err := m.Serialize()
	if err != nil {
		return err
	}
	_, err = w.Write(b)
	return err
}

// read reads one BGP message.
func read(r io.Reader) (*bgp.BGPMessage, error) {
	hdr := make([]byte, bgp.BGP_HEADER_LENGTH)
	if _, err := io.ReadFull(r, hdr); err != nil {
		return nil, err
	}
	n := int(binary.BigEndian.Uint16(hdr[16:18]))
	if n < bgp.BGP_HEADER_LENGTH || n > bgp.BGP_MAX_MESSAGE_LENGTH {
		return nil, fmt.Errorf("bad message length %d", n)
	}
	buf := make([]byte, n)
	copy(buf, hdr)
	if _, err := io.ReadFull(r, buf[bgp.BGP_HEADER_LENGTH:]); err != nil {
		return nil, err
	}
	return bgp.ParseBGPMessage(buf)
}
