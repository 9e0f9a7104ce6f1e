package main

import (
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"syscall"
	"time"
)

// serve is a pod's main process: it answers each TCP connection to port
// with "<hostname> <client address>" and closes it, until SIGTERM.
func serve(port string) error {
	ln, err := net.Listen("tcp", ":"+port)
	if err != nil {
		return fmt.Errorf("listen on %s: %w", port, err)
	}
	name, _ := os.Hostname()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			_, _ = fmt.Fprintf(c, "%s %s", name, c.RemoteAddr())
			_ = c.Close()
		}
	}()
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	<-sig
	return ln.Close()
}

// tcpGet connects to addr (host:port) and prints what it answers.
func tcpGet(addr string) error {
	c, err := net.DialTimeout("tcp", addr, 10*time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	b, err := io.ReadAll(c)
	if err != nil {
		return fmt.Errorf("read from %s: %w", addr, err)
	}
	fmt.Println(string(b))
	return nil
}
