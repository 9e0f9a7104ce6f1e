package agent

import (
	"cmp"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvipam/kvipam/internal/foundation/buildinfo"
)

// buildInfo is kvipam_build_info, the usual build gauge: always 1,
// labelled with the agent's version (Options.Version), commit and Go
// version, so that a query can tell which agents run which build (during
// a rolling upgrade, say) and join it onto the other series.
func buildInfo(version string) prometheus.Collector {
	bi := buildinfo.Read()
	g := prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "kvipam_build_info",
		Help: "Always 1, labelled with the agent's build: version, commit (unknown when the build recorded none) and Go version.",
	}, []string{"version", "commit", "goversion"})
	g.WithLabelValues(version, cmp.Or(bi.Commit, "unknown"), bi.Go).Set(1)
	return g
}
