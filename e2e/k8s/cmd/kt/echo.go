package main

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"time"

	"golang.org/x/net/icmp"
	"golang.org/x/net/ipv4"
	"golang.org/x/net/ipv6"
)

// errSend marks an echo that could not be sent (no route yet).
var errSend = errors.New("send")

// echoer sends ICMP echo requests to one address and waits for their
// replies (ping, ping-loop).
type echoer struct {
	c          *icmp.PacketConn
	typ, reply icmp.Type
	proto, id  int
	addr       netip.Addr
	buf        []byte
}

// openEcho opens a raw ICMP socket of addr's family; id tells this
// process's echoes apart.
func openEcho(addr netip.Addr, id int) (*echoer, error) {
	network, listen := "ip4:icmp", "0.0.0.0"
	e := &echoer{typ: ipv4.ICMPTypeEcho, reply: ipv4.ICMPTypeEchoReply, proto: 1, id: id, addr: addr, buf: make([]byte, 1500)}
	if addr.Is6() {
		network, listen = "ip6:ipv6-icmp", "::"
		e.typ, e.reply, e.proto = ipv6.ICMPTypeEchoRequest, ipv6.ICMPTypeEchoReply, 58
	}
	c, err := icmp.ListenPacket(network, listen)
	if err != nil {
		return nil, fmt.Errorf("listen %s: %w", network, err)
	}
	e.c = c
	return e, nil
}

func (e *echoer) Close() error { return e.c.Close() }

// echo sends echo seq and waits up to timeout for its reply: the
// replier's address, or why there was none.
func (e *echoer) echo(seq int, timeout time.Duration) (net.Addr, error) {
	msg := icmp.Message{Type: e.typ, Body: &icmp.Echo{ID: e.id, Seq: seq, Data: []byte("kvipam")}}
	b, err := msg.Marshal(nil)
	if err != nil {
		return nil, fmt.Errorf("marshal: %w", err)
	}
	if _, err := e.c.WriteTo(b, &net.IPAddr{IP: e.addr.AsSlice()}); err != nil {
		return nil, fmt.Errorf("%w to %s: %w", errSend, e.addr, err)
	}
	_ = e.c.SetReadDeadline(time.Now().Add(timeout))
	for {
		n, from, err := e.c.ReadFrom(e.buf)
		if err != nil {
			return nil, fmt.Errorf("no reply from %s: %w", e.addr, err)
		}
		m, err := icmp.ParseMessage(e.proto, e.buf[:n])
		if err != nil || m.Type != e.reply {
			continue
		}
		if r, ok := m.Body.(*icmp.Echo); ok && r.ID == e.id && r.Seq == seq {
			return from, nil
		}
	}
}
