package main

import (
	"fmt"
	"net/netip"
	"os"
	"os/signal"
	"syscall"
	"time"
)

// Pinging in a loop: one echo to each target at a time, the next 100 ms
// after the reply (or the loss); an echo with no reply within 3 s (a
// reply takes well under a millisecond here, even with the machine
// loaded) is lost.
const (
	loopInterval = 100 * time.Millisecond
	loopTimeout  = 3 * time.Second
	loopReport   = 10 // a "sent" line every this many echoes
)

// pingLoop pings every target until SIGTERM, each from its own
// goroutine and socket, and prints (to stdout, the pod's log):
//
//	up ADDR                    its first reply (echoes before it are not counted:
//	                           a route may still be on its way when the pod starts)
//	lost ADDR seq N            an echo counted and not answered
//	sent ADDR N lost M         every 10 counted echoes, and for each target at SIGTERM
func pingLoop(targets []string) error {
	addrs := make([]netip.Addr, len(targets))
	for i, t := range targets {
		a, err := netip.ParseAddr(t)
		if err != nil {
			return fmt.Errorf("parse %q: %w", t, err)
		}
		addrs[i] = a
	}
	out := make(chan string, 64)
	stop := make(chan struct{})
	done := make(chan struct{}, len(addrs))
	for i, a := range addrs {
		go func() {
			defer func() { done <- struct{}{} }()
			if err := pingTarget(a, (os.Getpid()+i)&0xffff, out, stop); err != nil {
				out <- fmt.Sprintf("error %s: %v", a, err)
			}
		}()
	}
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	running := len(addrs)
	for running > 0 {
		select {
		case l := <-out:
			fmt.Println(l)
		case <-sig:
			close(stop)
			sig = nil
		case <-done:
			running--
		}
	}
	for {
		select {
		case l := <-out:
			fmt.Println(l)
		default:
			return nil
		}
	}
}

func pingTarget(addr netip.Addr, id int, out chan<- string, stop <-chan struct{}) error {
	e, err := openEcho(addr, id)
	if err != nil {
		return err
	}
	defer e.Close()
	var up bool
	var sent, lost int
	for seq := 1; ; seq++ {
		select {
		case <-stop:
			if up {
				out <- fmt.Sprintf("sent %s %d lost %d", addr, sent, lost)
			}
			return nil
		default:
		}
		_, err := e.echo(seq&0xffff, loopTimeout)
		answered := err == nil
		switch {
		case answered && !up:
			up = true
			out <- "up " + addr.String()
		case up:
			sent++
			if !answered {
				lost++
				out <- fmt.Sprintf("lost %s seq %d", addr, seq)
			}
			if sent%loopReport == 0 {
				out <- fmt.Sprintf("sent %s %d lost %d", addr, sent, lost)
			}
		}
		time.Sleep(loopInterval)
	}
}
