package main

import (
	"context"
	"fmt"
	"io"
	"time"

	"github.com/kvipam/kvipam/agent/client"
)

// health is the exec probe of a container with no shell: readiness (the
// agent can allocate) by default, liveness (the agent answers on its
// socket, ready or not) with --live. It exits 0 when healthy, 1 otherwise
// with the reason. The agent answers the same on its metrics listener
// (/readyz, /livez), which an HTTP probe asks for far less CPU than an
// exec (agent/probes.go).
func runHealth(args []string, stdout, stderr io.Writer) int {
	cmd := newSubcommand("health", stderr)
	socket := cmd.flags.String("socket", client.DefaultSocket, "the agent's unix socket")
	timeout := cmd.flags.Duration("timeout", 2*time.Second, "how long to wait for the answer")
	live := cmd.flags.Bool("live", false, "liveness: the agent answers, ready or not")
	if code, done := cmd.parse(args); done {
		return code
	}
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	st, err := client.New(*socket, *timeout).Probe(ctx, *live)
	if err != nil {
		return cmd.fail("%v", err)
	}
	fmt.Fprintf(stdout, "node %s: ready=%t\n", st.Node, st.Ready)
	return 0
}
