package main

import (
	"io"

	"github.com/spf13/cobra"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/internal/foundation/buildinfo"
)

// versionInfo is what kvipamctl version prints.
type versionInfo struct {
	buildinfo.Info
	Schema string `json:"schema"`
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
	v := versionInfo{Info: buildinfo.Read(), Schema: etcdstore.Prefix}
	commit := v.Commit
	if commit == "" {
		commit = "unknown"
	}
	return a.render(w, v, func(tw io.Writer) {
		row(tw, "kvipamctl", v.Version)
		row(tw, "commit", commit)
		row(tw, "go", v.Go)
		row(tw, "etcd schema", v.Schema)
	})
}
