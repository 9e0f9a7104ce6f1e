package main

import (
	"io"
	"runtime"
	"runtime/debug"

	"github.com/spf13/cobra"

	"github.com/kvipam/kvipam/allocator/etcdstore"
)

// version is set at build time with -ldflags "-X main.version=v1.2.3".
var version = "dev"

// versionInfo is what kvipamctl version prints.
type versionInfo struct {
	Version string `json:"version"`
	Go      string `json:"go"`
	Schema  string `json:"schema"`
}

func (a *app) versionCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print kvipamctl's version and the etcd schema it reads",
		Args:  cobra.NoArgs,
		RunE:  func(_ *cobra.Command, _ []string) error { return a.version(a.stdout) },
	}
}

func (a *app) version(w io.Writer) error {
	v := versionInfo{Version: version, Go: runtime.Version(), Schema: etcdstore.Prefix}
	if bi, ok := debug.ReadBuildInfo(); ok && v.Version == "dev" && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
		v.Version = bi.Main.Version
	}
	return a.render(w, v, func(tw io.Writer) {
		row(tw, "kvipamctl", v.Version)
		row(tw, "go", v.Go)
		row(tw, "etcd schema", v.Schema)
	})
}
