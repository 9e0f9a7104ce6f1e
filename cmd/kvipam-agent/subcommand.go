package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
)

// subcommand is one of kvipam-agent's tools besides the daemon
// (install-cni, uninstall-cni, health): its flags, parsed and refused the
// same way for each, and its errors, named after it.
type subcommand struct {
	name   string
	flags  *flag.FlagSet
	stderr io.Writer
}

func newSubcommand(name string, stderr io.Writer) *subcommand {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	return &subcommand{name: name, flags: fs, stderr: stderr}
}

// parse parses args. When the run ends there, done is true and code is
// its exit code: 0 after -h, 2 for a flag it does not know or an argument
// (none takes one).
func (s *subcommand) parse(args []string) (code int, done bool) {
	if err := s.flags.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0, true
		}
		return 2, true
	}
	if s.flags.NArg() > 0 {
		fmt.Fprintf(s.stderr, "kvipam-agent %s: unexpected argument %q\n", s.name, s.flags.Arg(0))
		return 2, true
	}
	return 0, false
}

// fail reports err and is the exit code of a run that failed: 1.
func (s *subcommand) fail(format string, args ...any) int {
	fmt.Fprintf(s.stderr, "kvipam-agent %s: %s\n", s.name, fmt.Sprintf(format, args...))
	return 1
}
