package e2e

import (
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/stretchr/testify/require"
	"golang.org/x/net/icmp"
	"golang.org/x/net/ipv4"
	"golang.org/x/net/ipv6"
)

// pinger sends an ICMP echo request from a pod to an address (IPv4 or
// IPv6) every
// interval, for as long as a test runs, and records which were answered,
// so that the test can count the intervals in which packets were lost.
// Its raw socket is made in the pod's namespace and stays there, whatever
// thread later uses it.
type pinger struct {
	conn *icmp.PacketConn
	dst  netip.Addr
	// echo and reply are the family's ICMP types; proto its protocol
	// number, as icmp.ParseMessage wants it.
	echo, reply icmp.Type
	proto       int
	id          int
	every       time.Duration

	mu   sync.Mutex
	sent []time.Time // by sequence number
	got  map[int]bool

	stop chan struct{}
	wg   sync.WaitGroup
}

func startPinger(t testing.TB, from ns.NetNS, dst netip.Addr, every time.Duration) *pinger {
	t.Helper()
	network, laddr := "ip4:icmp", "0.0.0.0"
	p := &pinger{dst: dst, id: rand.IntN(0xffff), every: every, got: map[int]bool{}, stop: make(chan struct{}),
		echo: ipv4.ICMPTypeEcho, reply: ipv4.ICMPTypeEchoReply, proto: 1}
	if dst.Is6() {
		network, laddr = "ip6:ipv6-icmp", "::"
		p.echo, p.reply, p.proto = ipv6.ICMPTypeEchoRequest, ipv6.ICMPTypeEchoReply, 58
	}
	require.NoError(t, from.Do(func(ns.NetNS) (err error) {
		p.conn, err = icmp.ListenPacket(network, laddr)
		return err
	}))
	p.wg.Add(2)
	go p.send()
	go p.receive()
	t.Cleanup(p.close)
	return p
}

func (p *pinger) send() {
	defer p.wg.Done()
	tick := time.NewTicker(p.every)
	defer tick.Stop()
	for seq := 0; seq < 0xffff; seq++ {
		msg := icmp.Message{Type: p.echo, Body: &icmp.Echo{ID: p.id, Seq: seq, Data: []byte("kvipam-e2e")}}
		b, _ := msg.Marshal(nil)
		p.mu.Lock()
		p.sent = append(p.sent, time.Now())
		p.mu.Unlock()
		_, _ = p.conn.WriteTo(b, &net.IPAddr{IP: p.dst.AsSlice()}) // a failed send is a lost packet
		select {
		case <-p.stop:
			return
		case <-tick.C:
		}
	}
}

func (p *pinger) receive() {
	defer p.wg.Done()
	buf := make([]byte, 1500)
	for {
		n, peer, err := p.conn.ReadFrom(buf)
		if err != nil {
			return // closed
		}
		m, err := icmp.ParseMessage(p.proto, buf[:n])
		if err != nil || m.Type != p.reply || !peer.(*net.IPAddr).IP.Equal(p.dst.AsSlice()) {
			continue
		}
		if e, ok := m.Body.(*icmp.Echo); ok && e.ID == p.id {
			p.mu.Lock()
			p.got[e.Seq] = true
			p.mu.Unlock()
		}
	}
}

// finish stops the pingers at once, then waits a second for the last
// answers. It is safe to call twice.
func finish(ps ...*pinger) {
	for _, p := range ps {
		select {
		case <-p.stop:
			continue
		default:
		}
		close(p.stop)
		_ = p.conn.SetReadDeadline(time.Now().Add(time.Second))
	}
	for _, p := range ps {
		p.wg.Wait()
	}
}

func (p *pinger) close() {
	finish(p)
	_ = p.conn.Close()
}

// answeredSince counts the answers to requests sent after since.
func (p *pinger) answeredSince(since time.Time) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for seq, at := range p.sent {
		if at.After(since) && p.got[seq] {
			n++
		}
	}
	return n
}

// lossRun is a run of consecutive unanswered requests.
type lossRun struct {
	from, to time.Time
	lost     int
}

func (r lossRun) String() string {
	return fmt.Sprintf("%d lost over %s from %s", r.lost, r.to.Sub(r.from), r.from.Format("15:04:05.000"))
}

// losses are the runs of unanswered requests, after finish.
func (p *pinger) losses() (runs []lossRun, sent int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for seq, at := range p.sent {
		if p.got[seq] {
			continue
		}
		if n := len(runs); n > 0 && !p.got[seq-1] && seq > 0 {
			runs[n-1].to, runs[n-1].lost = at, runs[n-1].lost+1
			continue
		}
		runs = append(runs, lossRun{from: at, to: at, lost: 1})
	}
	return runs, len(p.sent)
}

// lostBetween counts the unanswered requests sent from from to to.
func (p *pinger) lostBetween(from, to time.Time) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for seq, at := range p.sent {
		if !at.Before(from) && at.Before(to) && !p.got[seq] {
			n++
		}
	}
	return n
}

// awaitAnswers waits until n requests sent after since have been
// answered, or the timeout passes (a test failure).
func (p *pinger) awaitAnswers(t testing.TB, timeout time.Duration, since time.Time, n int) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for p.answeredSince(since) < n {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %d answers from %s since %s", timeout, n, p.dst, since.Format("15:04:05.000"))
		}
		time.Sleep(p.every)
	}
}
