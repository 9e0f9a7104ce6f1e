package main

import (
	"context"
	"fmt"
	"io"
	"strings"

	"github.com/spf13/cobra"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/schema"
	"github.com/kvipam/kvipam/internal/foundation/buildinfo"
)

// versionInfo is what kvipamctl version prints.
type versionInfo struct {
	buildinfo.Info
	Schema string `json:"schema"`
	// SchemaLevel is the highest schema level kvipamctl understands.
	SchemaLevel schema.Level `json:"schemaLevel"`
	// Cluster is etcd's side: absent with --client.
	Cluster *clusterVersion `json:"cluster,omitempty"`
}

// clusterVersion is the cluster's schema level and each live node's
// version and level.
type clusterVersion struct {
	Level     schema.Level  `json:"level"`
	Downgrade bool          `json:"downgrade,omitempty"`
	SetBy     string        `json:"setBy,omitempty"`
	Features  []string      `json:"features"`
	Nodes     []nodeVersion `json:"nodes"`
}

type nodeVersion struct {
	Name     string       `json:"name"`
	Version  string       `json:"version"`
	Level    schema.Level `json:"level"`
	Features []string     `json:"features,omitempty"`
}

func (a *app) versionCmd() *cobra.Command {
	var clientOnly bool
	cmd := &cobra.Command{
		Use:   "version [--client]",
		Short: "Print kvipamctl's version, the cluster's schema level and each live node's version",
		Long: `Print kvipamctl's version and the etcd schema it understands, then, from
etcd, the cluster's schema level (the features every live node
understands, raised by the agents; held by kvipamctl downgrade enable)
and each live node's version and level. --client, or no etcd named
(--endpoints, KVIPAM_ETCD_ENDPOINTS), prints kvipamctl's side only. docs/operations.md, "Upgrading agents (rolling)" and "Upgrading bare-metal agents".`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if _, err := a.etcdConfig(); clientOnly || err != nil {
				// No etcd named (--endpoints, KVIPAM_ETCD_ENDPOINTS):
				// kvipamctl's own version is still a question it answers.
				return a.version(a.stdout, nil)
			}
			return a.withStore(cmd.Context(), func(s operatorStore) error {
				cv, err := readClusterVersion(cmd.Context(), s)
				if err != nil {
					return err
				}
				return a.version(a.stdout, cv)
			})
		},
	}
	cmd.Flags().BoolVar(&clientOnly, "client", false, "print kvipamctl's version only, without reading etcd")
	return cmd
}

// schemaReader reads what version and check say of the schema.
type schemaReader interface {
	ReadSchema(ctx context.Context) (etcdstore.SchemaSetting, error)
	ListNodes(ctx context.Context) ([]etcdstore.NodeRecord, error)
}

func readClusterVersion(ctx context.Context, s schemaReader) (*clusterVersion, error) {
	set, err := s.ReadSchema(ctx)
	if err != nil {
		return nil, err
	}
	nodes, err := s.ListNodes(ctx)
	if err != nil {
		return nil, err
	}
	cv := &clusterVersion{Level: set.Level, Downgrade: set.Downgrade, Features: []string{}, Nodes: []nodeVersion{}}
	if set.By != "" {
		cv.SetBy = strings.TrimSpace(set.By + " " + set.Version)
	}
	for _, f := range schema.Features() {
		if f.Level <= set.Level {
			cv.Features = append(cv.Features, f.Name)
		}
	}
	for _, n := range nodes {
		v := n.Version
		if v == "" {
			v = "unknown"
		}
		cv.Nodes = append(cv.Nodes, nodeVersion{Name: n.Name, Version: v, Level: etcdstore.NodeLevel(n), Features: n.Features})
	}
	return cv, nil
}

func (a *app) version(w io.Writer, cv *clusterVersion) error {
	v := versionInfo{Info: buildinfo.Read(), Schema: etcdstore.Prefix, SchemaLevel: schema.Highest(), Cluster: cv}
	commit := v.Commit
	if commit == "" {
		commit = "unknown"
	}
	return a.render(w, v, func(tw io.Writer) {
		row(tw, "kvipamctl", v.Version)
		row(tw, "commit", commit)
		row(tw, "go", v.Go)
		row(tw, "etcd schema", v.Schema)
		row(tw, "schema levels", fmt.Sprintf("up to %d", v.SchemaLevel))
		if cv == nil {
			return
		}
		level := fmt.Sprint(cv.Level)
		if cv.Downgrade {
			level += " (held by a downgrade: kvipamctl downgrade cancel lets the agents raise it)"
		}
		row(tw, "cluster schema level", level)
		row(tw, "cluster features", strings.Join(cv.Features, ", "))
		for _, n := range cv.Nodes {
			note := ""
			if n.Level < cv.Level {
				note = " BELOW THE CLUSTER'S LEVEL"
			}
			row(tw, "node "+n.Name, fmt.Sprintf("%s, level %d%s", n.Version, n.Level, note))
		}
	})
}
