package client

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"syscall"
	"time"
)

// maxIdle is how many open connections a client keeps for its next
// calls.
const maxIdle = 4

// transport carries requests to one agent socket over HTTP/1.1, keeping
// connections open between calls (a plugin makes two or three calls an
// ADD). It is a few hundred lines instead of net/http: linking net/http
// (and crypto/tls with it) made the plugin's every exec start slower
// (docs/cni.md, "Starting the plugin").
type transport struct {
	socket string
	mu     sync.Mutex
	idle   []*conn
}

// conn is one connection to the agent with its reader. read counts the
// bytes that came in, which tells a connection the agent had closed
// while it sat idle (nothing came back) from an answer cut short.
type conn struct {
	net.Conn
	br     *bufio.Reader
	read   int64
	reused bool
}

func (c *conn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.read += int64(n)
	return n, err
}

// roundTrip sends one request (req: its bytes, appendRequest's) and
// reads the answer, all before deadline (none when zero) and ctx's end.
// A kept-open connection that fails before any byte of the answer came
// back had been closed by the agent (it restarted, or shut idle
// connections down): the request goes once more on a new connection, as
// net/http does for an idle connection it finds closed; the agent's calls
// are idempotent. If the request had been sent on it and no agent
// answers the new dial, the agent went away mid-call: that is the first
// connection's error (ErrUnreachable, which a plugin waits out), not
// ErrNoAgent.
func (t *transport) roundTrip(ctx context.Context, req []byte, deadline time.Time) (*response, error) {
	var broken error
	for {
		c, err := t.get(ctx, deadline)
		if err != nil {
			if broken != nil && errors.Is(err, ErrNoAgent) {
				return nil, broken
			}
			return nil, err
		}
		resp, sent, err := t.exchange(ctx, c, req, deadline)
		if err == nil {
			return resp, nil
		}
		_ = c.Close()
		if !c.reused || c.read > 0 || ctx.Err() != nil || isTimeout(err) {
			return nil, err
		}
		if sent && broken == nil {
			broken = err
		}
	}
}

// exchange writes req on c and reads the answer; sent says the request
// was written whole. A connection whose answer leaves it reusable goes
// back to the idle list.
func (t *transport) exchange(ctx context.Context, c *conn, req []byte, deadline time.Time) (resp *response, sent bool, err error) {
	if err := c.SetDeadline(deadline); err != nil {
		return nil, false, fmt.Errorf("set deadline: %w", err)
	}
	// ctx's end interrupts a blocked write or read: an expired deadline.
	stop := context.AfterFunc(ctx, func() { _ = c.SetDeadline(time.Unix(1, 0)) })
	if _, err := c.Write(req); err != nil {
		stop()
		return nil, false, fmt.Errorf("send request: %w", ctxErr(ctx, err))
	}
	resp, err = readResponse(c.br)
	stopped := stop() // false: ctx ended, and c's deadline with it
	if err != nil {
		return nil, true, fmt.Errorf("read answer: %w", ctxErr(ctx, err))
	}
	if stopped && resp.keepAlive && c.br.Buffered() == 0 {
		t.put(c)
	} else {
		_ = c.Close()
	}
	return resp, true, nil
}

// get returns an idle connection, or dials one. A dial that finds no
// agent (no socket file, or nobody listening: ENOENT, ECONNREFUSED) is
// ErrNoAgent.
func (t *transport) get(ctx context.Context, deadline time.Time) (*conn, error) {
	t.mu.Lock()
	if n := len(t.idle); n > 0 {
		c := t.idle[n-1]
		t.idle = t.idle[:n-1]
		t.mu.Unlock()
		return c, nil
	}
	t.mu.Unlock()
	d := net.Dialer{Deadline: deadline}
	nc, err := d.DialContext(ctx, "unix", t.socket)
	if errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ECONNREFUSED) {
		return nil, fmt.Errorf("%w: %w", ErrNoAgent, err)
	}
	if err != nil {
		return nil, fmt.Errorf("dial: %w", err)
	}
	c := &conn{Conn: nc}
	c.br = bufio.NewReaderSize(c, 16<<10)
	return c, nil
}

// put keeps c for the next call, or closes it when maxIdle are kept.
func (t *transport) put(c *conn) {
	if err := c.SetDeadline(time.Time{}); err != nil {
		_ = c.Close()
		return
	}
	c.reused, c.read = true, 0
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.idle) >= maxIdle {
		_ = c.Close()
		return
	}
	t.idle = append(t.idle, c)
}

// ctxErr names ctx's end as the cause of err when ctx ended: a deadline
// set by ctx's cancellation reads as an I/O timeout otherwise.
func ctxErr(ctx context.Context, err error) error {
	if cerr := ctx.Err(); cerr != nil && !errors.Is(err, cerr) {
		return fmt.Errorf("%w (%w)", cerr, err)
	}
	return err
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// closeIdle closes the connections kept for later calls.
func (t *transport) closeIdle() {
	t.mu.Lock()
	idle := t.idle
	t.idle = nil
	t.mu.Unlock()
	for _, c := range idle {
		_ = c.Close()
	}
}
