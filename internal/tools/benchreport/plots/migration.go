package plots

import (
	"fmt"
	"strings"

	"github.com/kvipam/kvipam/internal/tools/benchreport"
)

// migrationBench is live migration's benchmark, one per routing
// (e2e BenchmarkMigration/routing=...).
const migrationBench = "BenchmarkMigration/routing="

// migrationFamilies are the VM's address families, in the plots' order.
var migrationFamilies = []string{"ipv4", "ipv6"}

// migration is the distribution over moves of the cut-over time, or of
// the time without answers (the pings lost, 10 ms apart), one line per
// routing and family, the IPv6 lines dashed beside their IPv4 ones.
func migration(set benchreport.SampleSet, series, title, xLabel, caption string) figure {
	f := figure{name: "migration-" + series, title: title, xLabel: xLabel, yLabel: "fraction of moves at most this long",
		caption: caption, missing: "no BenchmarkMigration samples (e2e, as root)"}
	for _, s := range set.Samples {
		routing, ok := strings.CutPrefix(s.Bench, migrationBench)
		if !ok {
			continue
		}
		for i, fam := range migrationFamilies {
			if ms := s.SeriesMS[fam+"-"+series]; len(ms) > 0 {
				f.add(line{label: routing + ", " + fam, source: fmt.Sprintf("%s (%s)", s.Bench, plural(max(s.Runs, 1), "move")),
					xy: cdf(ms), dashed: i > 0, sameColor: i > 0})
			}
		}
	}
	return f
}

// migrations are live migration's plots.
func migrations(set benchreport.SampleSet) []figure {
	return []figure{
		migration(set, "cutover", "Live migration: routes moved to the target", "time from the guest's announcement until every node routes the VM's address to the target (ms)",
			"Over the moves of a VM between two nodes, with a client pinging it from a third: the time from the guest's announcement in the target pod (a gratuitous ARP and an unsolicited NA; the source's interface down at the same instant) until every node's kernel, and in bgp mode the router's from FRR, routes the address to the target's node. Goal: 250 ms at p99."),
		migration(set, "unanswered", "Live migration: time without answers", "pings unanswered in a move, times 10 ms (ms)",
			"Over the same moves: the client's pings (every 10 ms) that went unanswered in a move, from the target pod's ADD to the next move's, as time. Goal: at most 25 pings (250 ms)."),
	}
}
