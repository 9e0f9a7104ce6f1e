// Package buildinfo says which build of kvipam a binary is: its version
// and commit, for every command's --version (and the CNI plugins' about
// text). `make build` sets both with -ldflags -X (see the Makefile), so a
// binary built from a git checkout says what `git describe --always
// --dirty` and `git rev-parse HEAD` said; otherwise they come from the
// module version and the VCS stamp the go command records, when it
// records one (GOFLAGS=-buildvcs=false, or no .git, leaves none).
package buildinfo

import (
	"fmt"
	"runtime"
	"runtime/debug"
	"strings"
)

// Set by the Makefile: -X github.com/kvipam/kvipam/internal/foundation/buildinfo.version=...
// and .commit=... Empty when built otherwise.
var version, commit string

// Info is one binary's build.
type Info struct {
	// Version is the -ldflags version, else the module's version (go
	// install module@v1.2.3), else "dev".
	Version string `json:"version"`
	// Commit is the -ldflags commit, else the VCS revision go build
	// stamped, with "-modified" when the tree had changes; "" when
	// unknown.
	Commit string `json:"commit,omitempty"`
	Go     string `json:"go"`
}

// Read returns this binary's Info.
func Read() Info {
	bi, _ := debug.ReadBuildInfo()
	return fromBuild(bi, version, commit)
}

// fromBuild is Read from explicit parts, for tests; bi may be nil.
func fromBuild(bi *debug.BuildInfo, ldVersion, ldCommit string) Info {
	i := Info{Version: ldVersion, Commit: ldCommit, Go: runtime.Version()}
	if bi == nil {
		bi = &debug.BuildInfo{}
	}
	if i.Version == "" && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
		i.Version = bi.Main.Version
	}
	if i.Version == "" {
		i.Version = "dev"
	}
	if i.Commit == "" {
		var rev string
		var modified bool
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				rev = s.Value
			case "vcs.modified":
				modified = s.Value == "true"
			}
		}
		if rev != "" && modified {
			rev += "-modified"
		}
		i.Commit = rev
	}
	return i
}

// String is the one line a --version prints after the program's name:
// "v0.4.0-3-gabc1234 (commit abc1234..., go1.26.0)".
func (i Info) String() string {
	parts := []string{}
	if i.Commit != "" {
		parts = append(parts, "commit "+i.Commit)
	} else {
		parts = append(parts, "commit unknown")
	}
	parts = append(parts, i.Go)
	return fmt.Sprintf("%s (%s)", i.Version, strings.Join(parts, ", "))
}
