// Command kt is the only binary of the test image the Kubernetes tests
// build (no registry is reachable, and the image has no shell):
//
//	kt sleep                    wait for SIGTERM or SIGINT (a pod's main process)
//	kt ping ADDR                ICMP echo to ADDR (IPv4 or IPv6) until one reply, at most 20 tries
//	kt ping-loop ADDR...        a pod's main process: ICMP echo to each ADDR every 100 ms until SIGTERM (ping-loop below)
//	kt install-cni SRC BIN CONF copy SRC's plugins into BIN and its *.conflist into CONF, atomically
//	kt udp-send ADDR            a UDP datagram to ADDR port 9999 every 100 ms, 100 of them
//	kt udp-source ADDR          listen on ADDR port 9999, print the source address of the first datagram (at most 60 s)
//	kt serve PORT               a pod's main process: answer each TCP connection to PORT with "HOSTNAME CLIENT" until SIGTERM
//	kt tcp-get HOST:PORT        connect and print the answer
package main

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

func main() {
	var err error
	switch {
	case len(os.Args) == 2 && os.Args[1] == "sleep":
		c := make(chan os.Signal, 1)
		signal.Notify(c, syscall.SIGTERM, syscall.SIGINT)
		<-c
	case len(os.Args) == 3 && os.Args[1] == "ping":
		err = ping(os.Args[2])
	case len(os.Args) >= 3 && os.Args[1] == "ping-loop":
		err = pingLoop(os.Args[2:])
	case len(os.Args) == 3 && os.Args[1] == "udp-send":
		err = udpSend(os.Args[2])
	case len(os.Args) == 3 && os.Args[1] == "udp-source":
		err = udpSource(os.Args[2])
	case len(os.Args) == 3 && os.Args[1] == "serve":
		err = serve(os.Args[2])
	case len(os.Args) == 3 && os.Args[1] == "tcp-get":
		err = tcpGet(os.Args[2])
	case len(os.Args) == 5 && os.Args[1] == "install-cni":
		err = installCNI(os.Args[2], os.Args[3], os.Args[4])
		if err == nil {
			fmt.Println("installed")
		}
	default:
		err = errors.New("usage: kt sleep | kt ping ADDR | kt ping-loop ADDR... | kt udp-send ADDR | kt udp-source ADDR | kt serve PORT | kt tcp-get HOST:PORT | kt install-cni SRC BIN CONF")
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "kt:", err)
		os.Exit(1)
	}
}

func ping(target string) error {
	addr, err := netip.ParseAddr(target)
	if err != nil {
		return fmt.Errorf("parse %q: %w", target, err)
	}
	e, err := openEcho(addr, os.Getpid()&0xffff)
	if err != nil {
		return err
	}
	defer e.Close()
	var last error
	for seq := 1; seq <= 20; seq++ {
		from, err := e.echo(seq, time.Second)
		if err == nil {
			fmt.Printf("reply from %s seq %d\n", from, seq)
			return nil
		}
		last = err
		if errors.Is(err, errSend) {
			time.Sleep(500 * time.Millisecond)
		}
	}
	return last
}

// udpPort is where udp-send sends and udp-source listens.
const udpPort = 9999

// udpSend sends datagrams to target: a listener that starts a moment
// later, or a first one lost to neighbour discovery, still gets one.
func udpSend(target string) error {
	addr, err := netip.ParseAddr(target)
	if err != nil {
		return fmt.Errorf("parse %q: %w", target, err)
	}
	// Unconnected: a port unreachable for a datagram sent before the
	// listener was up must not fail the next send.
	c, err := net.ListenUDP("udp", nil)
	if err != nil {
		return fmt.Errorf("open a udp socket: %w", err)
	}
	defer c.Close()
	to := netip.AddrPortFrom(addr, udpPort)
	for range 100 {
		if _, err := c.WriteToUDPAddrPort([]byte("kvipam"), to); err != nil {
			return fmt.Errorf("send to %s: %w", addr, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	fmt.Println("sent")
	return nil
}

// udpSource prints the source address of the first datagram that
// reaches listen.
func udpSource(listen string) error {
	addr, err := netip.ParseAddr(listen)
	if err != nil {
		return fmt.Errorf("parse %q: %w", listen, err)
	}
	c, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.AddrPortFrom(addr, udpPort)))
	if err != nil {
		return fmt.Errorf("listen on %s: %w", addr, err)
	}
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(time.Minute))
	_, from, err := c.ReadFromUDPAddrPort(make([]byte, 64))
	if err != nil {
		return fmt.Errorf("no datagram: %w", err)
	}
	fmt.Println(from.Addr().Unmap())
	return nil
}

// installCNI copies every regular file of src into binDir (plugins) or,
// for *.conflist, into confDir, each through a temporary file and rename.
func installCNI(src, binDir, confDir string) error {
	entries, err := os.ReadDir(src)
	if err != nil {
		return fmt.Errorf("read %s: %w", src, err)
	}
	for _, e := range entries {
		if e.IsDir() {
			continue
		}
		dir, mode := binDir, os.FileMode(0o755)
		if strings.HasSuffix(e.Name(), ".conflist") {
			dir, mode = confDir, 0o644
		}
		data, err := os.ReadFile(filepath.Join(src, e.Name()))
		if err != nil {
			return fmt.Errorf("read %s: %w", e.Name(), err)
		}
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return fmt.Errorf("mkdir %s: %w", dir, err)
		}
		tmp := filepath.Join(dir, "."+e.Name()+".tmp")
		if err := os.WriteFile(tmp, data, mode); err != nil {
			return fmt.Errorf("write %s: %w", tmp, err)
		}
		if err := os.Rename(tmp, filepath.Join(dir, e.Name())); err != nil {
			return fmt.Errorf("rename %s: %w", tmp, err)
		}
	}
	return nil
}
