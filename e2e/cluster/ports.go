package cluster

import (
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
)

// Ports come from below the kernel's ephemeral range: a port picked there
// by listening on :0 can be taken, while a member is down, by any outgoing
// connection's local port, and then Restart could not listen on it again.
const lowestPort = 20000

// usedPorts are the ports this process has handed out, never handed out
// twice.
var (
	portsMu   sync.Mutex
	usedPorts = map[int]bool{}
)

// freePort returns a loopback port nobody listened on a moment ago and
// that this process has not handed out before.
func freePort() (int, error) {
	portsMu.Lock()
	defer portsMu.Unlock()
	high := ephemeralLow()
	for range 1000 {
		port := 0 // the kernel's choice, when there is no room below the range
		if high-lowestPort >= 1000 {
			port = lowestPort + rand.IntN(high-lowestPort)
		}
		l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
		if err != nil {
			continue // in use, by us or anyone
		}
		port = l.Addr().(*net.TCPAddr).Port
		_ = l.Close()
		if !usedPorts[port] {
			usedPorts[port] = true
			return port, nil
		}
	}
	return 0, fmt.Errorf("find a free loopback port: none in 1000 tries")
}

// ephemeralLow is the lowest port of the kernel's ephemeral range (32768
// when it cannot be read).
func ephemeralLow() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return 32768
	}
	f := strings.Fields(string(b))
	if len(f) != 2 {
		return 32768
	}
	n, err := strconv.Atoi(f[0])
	if err != nil {
		return 32768
	}
	return n
}
