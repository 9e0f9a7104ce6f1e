package e2e

import (
	"os"
	"testing"
	"time"

	"github.com/kvipam/kvipam/internal/tools/benchreport"
)

// writeSamples writes a benchmark's raw samples (benchreport.Samples, the
// plots' input) into the directory KVIPAM_BENCH_SAMPLES names; unset, it
// does nothing. Bench is b's name; a later run of the same benchmark
// (go test runs it again with a larger b.N) replaces the file.
func writeSamples(b *testing.B, s benchreport.Samples, series map[string][]time.Duration, wall map[string]time.Duration) {
	b.Helper()
	dir := os.Getenv(benchreport.SamplesEnv)
	if dir == "" {
		return
	}
	s.Bench, s.SeriesMS = b.Name(), map[string][]float64{}
	for name, ds := range series {
		for _, d := range ds {
			s.SeriesMS[name] = append(s.SeriesMS[name], ms(d))
		}
	}
	for name, d := range wall {
		if s.WallMS == nil {
			s.WallMS = map[string]float64{}
		}
		s.WallMS[name] = ms(d)
	}
	if err := benchreport.WriteSamples(dir, s); err != nil {
		b.Fatalf("samples: %v", err)
	}
}
