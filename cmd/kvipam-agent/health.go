package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"time"

	"github.com/kvipam/kvipam/agent/client"
)

// health is the probe of a container with no shell: readiness (the agent
// can allocate) by default, liveness (the agent answers on its socket,
// ready or not) with --live. It exits 0 when healthy, 1 otherwise with
// the reason.
func runHealth(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("health", flag.ContinueOnError)
	fs.SetOutput(stderr)
	socket := fs.String("socket", client.DefaultSocket, "the agent's unix socket")
	timeout := fs.Duration("timeout", 2*time.Second, "how long to wait for the answer")
	live := fs.Bool("live", false, "liveness: the agent answers, ready or not")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	st, err := client.New(*socket, *timeout).Status(ctx)
	if err != nil {
		fmt.Fprintf(stderr, "kvipam-agent health: agent not answering on %s: %v\n", *socket, err)
		return 1
	}
	if *live || st.Ready {
		fmt.Fprintf(stdout, "node %s: ready=%t\n", st.Node, st.Ready)
		return 0
	}
	fmt.Fprintf(stderr, "kvipam-agent health: node %s not ready: %s\n", st.Node, st.Message)
	return 1
}
