package bgp

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// capNetBindService is CAP_NET_BIND_SERVICE's bit (linux/capability.h).
const capNetBindService = 10

// CheckListenPort refuses a listenPort the process cannot bind: one below
// net.ipv4.ip_unprivileged_port_start (1024 unless lowered), such as BGP's
// 179, without CAP_NET_BIND_SERVICE in its effective set. The DaemonSet
// drops every capability but NET_ADMIN and SYS_ADMIN, so an agent asked
// to listen on 179 there is told why at start, by the key, instead of
// GoBGP's "bind: permission denied". Port 0 (connect out only) and ports
// from the unprivileged start need nothing.
func CheckListenPort(port int32) error {
	if port <= 0 {
		return nil
	}
	start := 1024
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_unprivileged_port_start"); err == nil {
		if v, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil {
			start = v
		}
	}
	return checkListenPort(port, start, hasEffectiveCap(capNetBindService))
}

func checkListenPort(port int32, unprivilegedStart int, canBind bool) error {
	if int(port) >= unprivilegedStart || canBind {
		return nil
	}
	return fmt.Errorf("bgp: listenPort: %d is below %d (net.ipv4.ip_unprivileged_port_start) and the agent lacks CAP_NET_BIND_SERVICE: "+
		"add NET_BIND_SERVICE to the agent container's capabilities (the DaemonSet drops it), listen on a port from %d, or set 0 to connect out only",
		port, unprivilegedStart, unprivilegedStart)
}

// hasEffectiveCap reports whether the process's effective capability set
// (CapEff in /proc/self/status) holds capability bit; false if unknown.
func hasEffectiveCap(bit uint) bool {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		v, ok := strings.CutPrefix(sc.Text(), "CapEff:")
		if !ok {
			continue
		}
		caps, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
		return err == nil && caps&(1<<bit) != 0
	}
	return false
}
