package main

import (
	"fmt"
	"io"

	"github.com/kvipam/kvipam/internal/foundation/buildinfo"
)

// runVersion is `kvipam-agent version`: the same line as --version, as
// kvipamctl has both.
func runVersion(args []string, stdout, stderr io.Writer) int {
	s := newSubcommand("version", stderr)
	if code, done := s.parse(args); done {
		return code
	}
	printVersion(stdout)
	return 0
}

// printVersion writes the build's version, commit and Go version.
func printVersion(w io.Writer) {
	fmt.Fprintln(w, "kvipam-agent", buildinfo.Read())
}
