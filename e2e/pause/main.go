// Command pause is the process of the sandbox image the CRI tests build:
// it waits for SIGTERM or SIGINT, as the pause container does.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	c := make(chan os.Signal, 1)
	signal.Notify(c, syscall.SIGTERM, syscall.SIGINT)
	<-c
}
