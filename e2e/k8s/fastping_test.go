package k8s

import (
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/netip"
	"os"
	"sync"
	"time"

	"golang.org/x/net/icmp"
	"golang.org/x/net/ipv4"
	"golang.org/x/net/ipv6"
)

// fastPinger sends an ICMP echo request to one address every interval
// from a raw socket in a pod's network namespace (the pod's own network:
// its address, its routes, its node), and records when each was sent and
// when its reply, or an ICMP error about it, came back. The echoes are
// numbered in their data (a 64-bit sequence), so none is confused with
// another after the 16-bit ICMP sequence wraps. Safe for concurrent use.
type fastPinger struct {
	addr     netip.Addr
	interval time.Duration
	c        *icmp.PacketConn
	id       int
	proto    int
	req      icmp.Type

	mu      sync.Mutex
	sent    []time.Time // by sequence
	replied []time.Time // zero: no reply (yet)
	icmpErr []icmpError // the ICMP error that came back for it, if any
	sendErr int         // sends that failed (no route in the pod)
	// errors counts the ICMP errors by kind and sender ("destination
	// unreachable code 1 from 172.30.0.11").
	errors map[string]int

	stop chan struct{}
	done sync.WaitGroup
}

// startFastPinger opens the socket in the namespace at netnsPath and
// starts pinging addr every interval until stop.
func startFastPinger(netnsPath string, addr netip.Addr, interval time.Duration) (*fastPinger, error) {
	p := &fastPinger{addr: addr, interval: interval, id: os.Getpid() & 0xffff, proto: 1, req: ipv4.ICMPTypeEcho, stop: make(chan struct{})}
	network, listen := "ip4:icmp", "0.0.0.0"
	if addr.Is6() {
		network, listen, p.proto, p.req = "ip6:ipv6-icmp", "::", 58, ipv6.ICMPTypeEchoRequest
		p.id = (p.id + 1) & 0xffff
	}
	err := inNetns(netnsPath, func() error {
		c, err := icmp.ListenPacket(network, listen)
		if err != nil {
			return fmt.Errorf("listen %s: %w", network, err)
		}
		p.c = c
		return nil
	})
	if err != nil {
		return nil, err
	}
	p.done.Add(2)
	go p.receive()
	go p.send()
	return p, nil
}

func (p *fastPinger) send() {
	defer p.done.Done()
	tick := time.NewTicker(p.interval)
	defer tick.Stop()
	data := make([]byte, 16)
	copy(data[8:], "kvipam-m")
	for {
		p.mu.Lock()
		seq := uint64(len(p.sent))
		p.sent = append(p.sent, time.Now())
		p.replied = append(p.replied, time.Time{})
		p.icmpErr = append(p.icmpErr, noError)
		p.mu.Unlock()
		binary.BigEndian.PutUint64(data, seq)
		msg := icmp.Message{Type: p.req, Body: &icmp.Echo{ID: p.id, Seq: int(seq & 0xffff), Data: data}}
		b, err := msg.Marshal(nil)
		if err == nil {
			_, err = p.c.WriteTo(b, &net.IPAddr{IP: p.addr.AsSlice()})
		}
		if err != nil {
			p.mu.Lock()
			p.sendErr++
			p.mu.Unlock()
		}
		select {
		case <-p.stop:
			return
		case <-tick.C:
		}
	}
}

// receive records replies and ICMP errors (destination unreachable,
// time exceeded) that quote one of this pinger's echoes.
func (p *fastPinger) receive() {
	defer p.done.Done()
	buf := make([]byte, 1500)
	for {
		n, from, err := p.c.ReadFrom(buf)
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue
		}
		at := time.Now()
		m, err := icmp.ParseMessage(p.proto, buf[:n])
		if err != nil {
			continue
		}
		switch body := m.Body.(type) {
		case *icmp.Echo:
			if (m.Type == ipv4.ICMPTypeEchoReply || m.Type == ipv6.ICMPTypeEchoReply) && body.ID == p.id && len(body.Data) >= 8 {
				p.mark(binary.BigEndian.Uint64(body.Data), func(seq uint64) {
					if p.replied[seq].IsZero() {
						p.replied[seq] = at
					}
				})
			}
		case *icmp.DstUnreach:
			p.markQuoted(body.Data, unreachable, fmt.Sprintf("destination unreachable code %d from %s", m.Code, from))
		case *icmp.TimeExceeded:
			p.markQuoted(body.Data, timeExceeded, fmt.Sprintf("time exceeded code %d from %s", m.Code, from))
		}
	}
}

// icmpError is the kind of ICMP error an echo got instead of its reply.
type icmpError int

const (
	noError icmpError = iota
	// unreachable: a router or host had no way to the address (a route
	// missing, or an unreachable route): refused.
	unreachable
	// timeExceeded: the echo's hop limit ran out, as in a routing loop.
	timeExceeded
)

// markQuoted records kind (what, in words) for the echo an ICMP error
// quotes (its IP header, then at least the echo's 8-byte header and, here,
// its data).
func (p *fastPinger) markQuoted(quoted []byte, kind icmpError, what string) {
	hdr := 20
	if p.addr.Is6() {
		hdr = 40
	} else if len(quoted) > 0 {
		hdr = int(quoted[0]&0x0f) * 4
	}
	if len(quoted) < hdr+16 {
		return
	}
	e := quoted[hdr:]
	if int(binary.BigEndian.Uint16(e[4:6])) != p.id {
		return
	}
	p.mark(binary.BigEndian.Uint64(e[8:16]), func(seq uint64) {
		p.icmpErr[seq] = kind
		if p.errors == nil {
			p.errors = map[string]int{}
		}
		p.errors[what]++
	})
}

func (p *fastPinger) mark(seq uint64, f func(seq uint64)) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if seq < uint64(len(p.sent)) {
		f(seq)
	}
}

// firstReplySince is the reply time of the first echo sent at or after t
// that was answered; ok is false while none is.
func (p *fastPinger) firstReplySince(t time.Time) (time.Time, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for i, s := range p.sent {
		if !s.Before(t) && !p.replied[i].IsZero() {
			return p.replied[i], true
		}
	}
	return time.Time{}, false
}

// Close stops sending, waits grace for the last replies, and closes the
// socket.
func (p *fastPinger) Close(grace time.Duration) {
	select {
	case <-p.stop:
		return
	default:
	}
	close(p.stop)
	time.Sleep(grace)
	_ = p.c.Close()
	p.done.Wait()
}

// pingFigures are what a pinger saw of the echoes sent in [from, to).
type pingFigures struct {
	Sent, Lost int
	// Unreachable and TimeExceeded count the echoes that got that ICMP
	// error instead of a reply.
	Unreachable, TimeExceeded int
	// FirstLost and LastLost are the send times of the first and last
	// echo lost (zero when none was).
	FirstLost, LastLost time.Time
}

func (p *fastPinger) figures(from, to time.Time) pingFigures {
	p.mu.Lock()
	defer p.mu.Unlock()
	var f pingFigures
	for i, s := range p.sent {
		if s.Before(from) || !s.Before(to) {
			continue
		}
		f.Sent++
		switch p.icmpErr[i] {
		case unreachable:
			f.Unreachable++
		case timeExceeded:
			f.TimeExceeded++
		}
		if p.replied[i].IsZero() {
			f.Lost++
			if f.FirstLost.IsZero() {
				f.FirstLost = s
			}
			f.LastLost = s
		}
	}
	return f
}

// icmpErrors counts the ICMP errors about this pinger's echoes, by kind
// and sender.
func (p *fastPinger) icmpErrors() map[string]int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return maps.Clone(p.errors)
}

// sendErrors counts the sends that failed.
func (p *fastPinger) sendErrors() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.sendErr
}
