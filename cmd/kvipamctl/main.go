// Command kvipamctl is kvipam's operator CLI. It talks to etcd directly, so
// it works when every agent is down: it lists pools, blocks and addresses,
// checks the invariants of docs/design.md, and makes the few audited
// repairs an operator may make (release addresses, remove a dead node).
//
// Exit codes: 0 success, 1 check found problems, 2 any error.
//
// See docs/kvipamctl.md for usage.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := Run(ctx, os.Args[1:], os.Stdout, os.Stderr, os.Getenv)
	stop()
	os.Exit(code)
}

// Exit codes of kvipamctl.
const (
	exitOK       = 0
	exitFindings = 1
	exitError    = 2
)

// exitCode ends a command with a code other than exitError and no message
// of its own (the command printed its output already).
type exitCode int

func (c exitCode) Error() string { return fmt.Sprintf("exit status %d", int(c)) }

// Run runs kvipamctl with args (without the program name), writing output
// to stdout and errors, progress and audit lines to stderr, and reading the
// environment through getenv. It returns the process exit code. Tests call
// it in-process.
func Run(ctx context.Context, args []string, stdout, stderr io.Writer, getenv func(string) string) int {
	a := &app{stdout: stdout, stderr: stderr, getenv: getenv, now: time.Now}
	defer a.close()
	root := a.rootCmd()
	root.SetArgs(args)
	root.SetOut(stdout)
	root.SetErr(stderr)
	err := root.ExecuteContext(ctx)
	var code exitCode
	switch {
	case err == nil:
		return exitOK
	case errors.As(err, &code):
		return int(code)
	default:
		fmt.Fprintf(stderr, "kvipamctl: %v\n", err)
		return exitError
	}
}
