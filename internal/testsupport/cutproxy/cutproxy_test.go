package cutproxy

import (
	"bufio"
	"errors"
	"io"
	"net"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// echo serves one loopback echo listener for the test.
func echo(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { _, _ = io.Copy(c, c); c.Close() }()
		}
	}()
	return ln.Addr().String()
}

func roundTrip(t *testing.T, c net.Conn, r *bufio.Reader, msg string) {
	t.Helper()
	_, err := c.Write([]byte(msg + "\n"))
	require.NoError(t, err)
	line, err := r.ReadString('\n')
	require.NoError(t, err)
	require.Equal(t, msg+"\n", line)
}

// proxied is a proxy to an echo listener and a connection through it,
// which has echoed one line.
func proxied(t *testing.T) (*Proxy, net.Conn, *bufio.Reader) {
	p, err := New(echo(t))
	require.NoError(t, err)
	t.Cleanup(p.Close)
	c, err := net.Dial("tcp", p.Addr())
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	r := bufio.NewReader(c)
	roundTrip(t, c, r, "before")
	return p, c, r
}

// TestStallHoldsTrafficUntilHeal: a stalled proxy delivers nothing either
// way and keeps the connection; once healed, what was sent arrives.
func TestStallHoldsTrafficUntilHeal(t *testing.T) {
	p, c, r := proxied(t)

	p.Stall()
	_, err := c.Write([]byte("during\n"))
	require.NoError(t, err)
	require.NoError(t, c.SetReadDeadline(time.Now().Add(300*time.Millisecond)))
	_, err = r.ReadString('\n')
	require.True(t, errors.Is(err, os.ErrDeadlineExceeded), "nothing comes back while stalled: %v", err)

	p.Heal()
	require.NoError(t, c.SetReadDeadline(time.Time{}))
	line, err := r.ReadString('\n')
	require.NoError(t, err)
	require.Equal(t, "during\n", line, "the bytes sent while stalled arrive once healed")
	roundTrip(t, c, r, "after")
}

// TestCutResetsAndRefuses: a cut proxy drops its connections and refuses
// new ones until healed.
func TestCutResetsAndRefuses(t *testing.T) {
	p, _, r := proxied(t)
	p.Cut()
	_, err := r.ReadString('\n')
	require.Error(t, err, "the connection is dropped")
	c2, err := net.Dial("tcp", p.Addr())
	require.NoError(t, err)
	_, err = bufio.NewReader(c2).ReadString('\n')
	require.Error(t, err, "a new connection is closed at once")
	c2.Close()
	p.Heal()
	c3, err := net.Dial("tcp", p.Addr())
	require.NoError(t, err)
	defer c3.Close()
	roundTrip(t, c3, bufio.NewReader(c3), "healed")
}
