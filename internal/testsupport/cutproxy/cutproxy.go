// Package cutproxy forwards loopback TCP to a target, and can partition
// it in two ways without touching the host's network: Stall drops the
// traffic as a network that loses every packet would (nothing arrives
// either way, connections hang, and what was sent is delivered once
// healed, as TCP retransmits it), and Cut resets every connection and
// refuses new ones. Either stands for a partition between one process
// and etcd, with everything else still connected.
package cutproxy

import (
	"net"
	"sync"
)

// Proxy is one forwarding listener. It is safe for concurrent use.
type Proxy struct {
	ln     net.Listener
	target string
	mu     sync.Mutex
	flow   *sync.Cond // signalled when cut or stalled change
	cut    bool
	stall  bool
	conns  map[net.Conn]bool
}

// New listens on a free loopback port and forwards to target.
func New(target string) (*Proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	return Serve(ln, target), nil
}

// Serve forwards what ln accepts to target. The listener may be in
// another network namespace than the one target is reached from (a
// socket keeps the namespace it was made in): a process in a node's
// namespace then reaches an etcd on the test host's loopback.
func Serve(ln net.Listener, target string) *Proxy {
	p := &Proxy{ln: ln, target: target, conns: map[net.Conn]bool{}}
	p.flow = sync.NewCond(&p.mu)
	go p.serve()
	return p
}

func (p *Proxy) serve() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		go p.handle(c)
	}
}

// handle connects c upstream once traffic flows: a connection made
// while stalled waits, as a SYN would go unanswered.
func (p *Proxy) handle(c net.Conn) {
	if !p.waitFlow() {
		c.Close()
		return
	}
	up, err := net.Dial("tcp", p.target)
	if err != nil {
		c.Close()
		return
	}
	p.mu.Lock()
	if p.cut {
		p.mu.Unlock()
		c.Close()
		up.Close()
		return
	}
	p.conns[c], p.conns[up] = true, true
	p.mu.Unlock()
	go p.pipe(up, c)
	go p.pipe(c, up)
}

// waitFlow waits while stalled; false if cut.
func (p *Proxy) waitFlow() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for p.stall && !p.cut {
		p.flow.Wait()
	}
	return !p.cut
}

// pipe copies src to dst; bytes read while stalled wait to be written
// until healed.
func (p *Proxy) pipe(dst, src net.Conn) {
	defer dst.Close()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if !p.waitFlow() {
				return
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// Stall stops all traffic without closing anything, until Heal.
func (p *Proxy) Stall() {
	p.mu.Lock()
	p.stall = true
	p.mu.Unlock()
}

// Cut drops every connection and refuses new ones, until Heal.
func (p *Proxy) Cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cut = true
	for c := range p.conns {
		c.Close()
	}
	clear(p.conns)
	p.flow.Broadcast()
}

// Heal forwards again.
func (p *Proxy) Heal() {
	p.mu.Lock()
	p.cut, p.stall = false, false
	p.mu.Unlock()
	p.flow.Broadcast()
}

// Addr is the proxy's host:port.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Close stops the proxy and drops its connections.
func (p *Proxy) Close() {
	p.ln.Close()
	p.Cut()
}
