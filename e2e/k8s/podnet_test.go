package k8s

import (
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// --- a pod's network namespace, reached from the test (root, on the host) ---

// podNetns is the network namespace of pod p, as /proc/PID/ns/net of a
// process of its sandbox: kubelet (cgroupfs driver) puts every container
// of the pod, the sandbox's pause first, in the pod's cgroup, named
// pod<UID> under the node's cgroup root.
func (c *kcluster) podNetns(p pod) (string, error) {
	n := c.node(p.Spec.NodeName)
	if n == nil {
		return "", fmt.Errorf("pod %s/%s is on node %q, not one of the cluster's", p.Metadata.Namespace, p.Metadata.Name, p.Spec.NodeName)
	}
	names := map[string]bool{"pod" + p.Metadata.UID: true, "pod" + strings.ReplaceAll(p.Metadata.UID, "-", "_"): true}
	for _, d := range cgroupDirs() {
		var pids []int
		_ = filepath.WalkDir(filepath.Join(d, n.cgroup), func(path string, e os.DirEntry, err error) error {
			if err != nil || !e.IsDir() || !names[e.Name()] {
				return nil
			}
			pids = append(pids, cgroupProcs(strings.TrimPrefix(path, d))...)
			return filepath.SkipDir
		})
		for _, pid := range pids {
			path := "/proc/" + strconv.Itoa(pid) + "/ns/net"
			if _, err := os.Stat(path); err == nil {
				return path, nil
			}
		}
	}
	return "", fmt.Errorf("no process of pod %s/%s (uid %s) in node %s's cgroups", p.Metadata.Namespace, p.Metadata.Name, p.Metadata.UID, n.name)
}

func (c *kcluster) node(name string) *knode {
	for _, n := range c.nodes {
		if n.name == name {
			return n
		}
	}
	return nil
}

// inNetns runs fn on an OS thread in the network namespace at path, and
// puts the thread back in its own namespace after. A socket fn opens
// stays in the namespace wherever it is used from. The thread must not
// end while in the pod's namespace, nor at all: the cluster's processes
// are started with Pdeathsig, which the kernel sends when the thread that
// started one ends, and Go ends a thread whose goroutine exits locked to
// it. So a thread that cannot go back is kept (parked) instead.
func inNetns(path string, fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		own, err := os.Open("/proc/thread-self/ns/net")
		if err != nil {
			runtime.UnlockOSThread()
			errc <- err
			return
		}
		defer own.Close()
		f, err := os.Open(path)
		if err != nil {
			runtime.UnlockOSThread()
			errc <- err
			return
		}
		defer f.Close()
		if err := unix.Setns(int(f.Fd()), unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("enter %s: %w", path, err)
			return
		}
		errc <- fn()
		if err := unix.Setns(int(own.Fd()), unix.CLONE_NEWNET); err != nil {
			select {} // never scheduled again, never ended
		}
		runtime.UnlockOSThread()
	}()
	return <-errc
}

// inEchos counts the ICMP and ICMPv6 echo requests the namespace at path
// received (Icmp InEchos and Icmp6 InEchos of its snmp files), answered
// or not.
func inEchos(path string) (v4, v6 int, err error) {
	err = inNetns(path, func() error {
		b, err := os.ReadFile("/proc/thread-self/net/snmp")
		if err != nil {
			return err
		}
		if v4, err = snmpField(string(b), "Icmp:", "InEchos"); err != nil {
			return err
		}
		b, err = os.ReadFile("/proc/thread-self/net/snmp6")
		if err != nil {
			return err
		}
		for _, l := range strings.Split(string(b), "\n") {
			if f := strings.Fields(l); len(f) == 2 && f[0] == "Icmp6InEchos" {
				v6, err = strconv.Atoi(f[1])
				return err
			}
		}
		return fmt.Errorf("no Icmp6InEchos in snmp6")
	})
	return v4, v6, err
}

// snmpField is field of section (a header line and a value line) in
// /proc/net/snmp's text.
func snmpField(text, section, field string) (int, error) {
	var head []string
	for _, l := range strings.Split(text, "\n") {
		f := strings.Fields(l)
		if len(f) == 0 || f[0] != section {
			continue
		}
		if head == nil {
			head = f
			continue
		}
		for i, h := range head {
			if h == field && i < len(f) {
				return strconv.Atoi(f[i])
			}
		}
	}
	return 0, fmt.Errorf("no %s %s in snmp", section, field)
}

// stopAnswering makes the namespace at path ignore ICMP and ICMPv6 echo
// requests (its own sysctls, nothing of the host's): a guest paused on
// the source node of its migration answers nothing.
func stopAnswering(path string) error {
	return inNetns(path, func() error {
		for _, f := range []string{"/proc/sys/net/ipv4/icmp_echo_ignore_all", "/proc/sys/net/ipv6/icmp/echo_ignore_all"} {
			if err := os.WriteFile(f, []byte("1\n"), 0o644); err != nil {
				return err
			}
		}
		return nil
	})
}

// garpSender sends gratuitous ARP requests (sender and target protocol
// address both the announced address, broadcast: what arping -U and a
// guest resuming after a migration send) out of one interface of a pod's
// namespace. The packet socket stays in that namespace, so a send is one
// system call.
type garpSender struct {
	fd      int
	ifindex int
	frame   []byte
}

func newGARPSender(netnsPath, ifName string, addr netip.Addr) (*garpSender, error) {
	if !addr.Is4() {
		return nil, fmt.Errorf("gratuitous ARP for %s: not IPv4", addr)
	}
	s := &garpSender{fd: -1}
	err := inNetns(netnsPath, func() error {
		ifc, err := net.InterfaceByName(ifName)
		if err != nil {
			return fmt.Errorf("find %s: %w", ifName, err)
		}
		if len(ifc.HardwareAddr) != 6 {
			return fmt.Errorf("%s has no Ethernet address", ifName)
		}
		s.ifindex, s.frame = ifc.Index, garpFrame(ifc.HardwareAddr, addr)
		s.fd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("open a packet socket: %w", err)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return s, nil
}

func (s *garpSender) send() error {
	sa := &unix.SockaddrLinklayer{Ifindex: s.ifindex, Halen: 6}
	copy(sa.Addr[:], s.frame[0:6])
	if err := unix.Sendto(s.fd, s.frame, 0, sa); err != nil {
		return fmt.Errorf("send a gratuitous ARP: %w", err)
	}
	return nil
}

func (s *garpSender) Close() error { return unix.Close(s.fd) }

// garpFrame is an Ethernet broadcast of an ARP request from mac whose
// sender and target protocol addresses are both addr.
func garpFrame(mac net.HardwareAddr, addr netip.Addr) []byte {
	f := make([]byte, 42)
	copy(f[0:6], []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff})
	copy(f[6:12], mac)
	binary.BigEndian.PutUint16(f[12:], 0x0806)
	a := f[14:]
	binary.BigEndian.PutUint16(a[0:], 1) // Ethernet
	binary.BigEndian.PutUint16(a[2:], 0x0800)
	a[4], a[5] = 6, 4
	binary.BigEndian.PutUint16(a[6:], 1) // request
	copy(a[8:14], mac)
	ip := addr.As4()
	copy(a[14:18], ip[:])
	copy(a[24:28], ip[:])
	return f
}
