package benchreport

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

// SamplesEnv names the directory the benchmarks write their raw samples
// to, an absolute path since go test runs each package in its own
// directory (make bench-run sets it to bench-out/samples); unset, they
// write none.
const SamplesEnv = "KVIPAM_BENCH_SAMPLES"

// Samples is one sample file of a benchmark, <dir>/<Bench>[.<Datapath>].json
// with the slashes of Bench as '_' (SamplesFile), written by the e2e
// benchmarks when SamplesEnv is set. The plots are drawn from these:
//
//	{"bench": "BenchmarkAddDel/concurrency=1", "datapath": "bpf", "concurrency": 1,
//	 "series_ms": {"kvipam-add": [12.1, 11.8, ...], "bridge-add": [...], ...},
//	 "wall_ms": {"kvipam": 9123.4, "bridge": 8011.2}}
//
// The series of each benchmark:
//   - BenchmarkAddDel/concurrency=N: kvipam-add, kvipam-del, bridge-add,
//     bridge-del, each operation's latency; wall_ms kvipam and bridge,
//     the time all of a plugin's iterations (ADD then DEL) took.
//   - BenchmarkAddDatapath: routes-add, routes-del, bpf-add, bpf-del,
//     bpf-tcx-add, bpf-tcx-del, each operation's latency.
//   - BenchmarkBurst100: kvipam, bridge, floor, each pod's ADD completion
//     time since its burst's start, pooled over runs bursts.
//   - BenchmarkK8sBurst/burst=N (e2e/k8s, through a real kubelet): per
//     network (kvipam, kvipam-routes, bridge, hostnet), each pod's time
//     from its creation to Ready (NET), its sandbox's RunPodSandbox
//     (NET-sandbox) and that sandbox's CNI ADD (NET-cni-add), pooled over
//     runs rounds.
type Samples struct {
	Bench string `json:"bench"`
	// Datapath is the kvipam agent's datapath (routes, bpf) when the
	// benchmark runs one; empty when its series name their datapaths.
	Datapath string `json:"datapath,omitempty"`
	// Concurrency is how many operations were under way at once.
	Concurrency int `json:"concurrency,omitempty"`
	// Runs is how many repetitions the series pool (bursts).
	Runs     int                  `json:"runs,omitempty"`
	SeriesMS map[string][]float64 `json:"series_ms"`
	WallMS   map[string]float64   `json:"wall_ms,omitempty"`
}

// Storm is one claim storm's samples, <dir>/storm-<anything>.json, for
// the allocator's BenchmarkClaimStorm to write:
//
//	{"nodes": 5000, "completions_ms": [3.2, 3.9, ...], "baseline_completions_ms": [...]}
//
// CompletionsMS holds, for each node that claimed its block, the time
// from the storm's start to its claim's completion, in milliseconds (any
// order). BaselineCompletionsMS, optional, is the same for the storm's
// baseline (as many bare create-if-absent transactions at once).
type Storm struct {
	Nodes                 int       `json:"nodes"`
	CompletionsMS         []float64 `json:"completions_ms"`
	BaselineCompletionsMS []float64 `json:"baseline_completions_ms,omitempty"`
}

// SampleSet is every sample file of a directory.
type SampleSet struct {
	Samples []Samples // in file name order
	Storms  []Storm   // by number of nodes
}

// SamplesFile is the file name of s in a samples directory.
func SamplesFile(s Samples) string {
	name := strings.ReplaceAll(s.Bench, "/", "_")
	if s.Datapath != "" {
		name += "." + s.Datapath
	}
	return name + ".json"
}

// WriteSamples writes s into dir (created if missing) under SamplesFile,
// replacing an earlier run's.
func WriteSamples(dir string, s Samples) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	b, err := json.Marshal(s)
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, SamplesFile(s)), b, 0o644)
}

// WriteStorm writes a claim storm's completions into dir (created if
// missing) as storm-<name>.json, replacing an earlier run's.
func WriteStorm(dir, name string, s Storm) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	b, err := json.Marshal(s)
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "storm-"+name+".json"), b, 0o644)
}

// ReadSamples reads every *.json file of dir: storm-*.json as Storm, the
// others as Samples. A missing directory is an empty set.
func ReadSamples(dir string) (SampleSet, error) {
	var set SampleSet
	files, err := filepath.Glob(filepath.Join(dir, "*.json"))
	if err != nil {
		return set, err
	}
	sort.Strings(files)
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			return set, err
		}
		if strings.HasPrefix(filepath.Base(f), "storm-") {
			var s Storm
			if err := json.Unmarshal(b, &s); err != nil {
				return set, fmt.Errorf("%s: %w", f, err)
			}
			set.Storms = append(set.Storms, s)
			continue
		}
		var s Samples
		if err := json.Unmarshal(b, &s); err != nil {
			return set, fmt.Errorf("%s: %w", f, err)
		}
		if s.Bench == "" {
			return set, fmt.Errorf("%s: no bench", f)
		}
		set.Samples = append(set.Samples, s)
	}
	sort.SliceStable(set.Storms, func(i, j int) bool { return set.Storms[i].Nodes < set.Storms[j].Nodes })
	return set, nil
}

// Find returns the samples of bench with datapath ("" matches any).
func (set SampleSet) Find(bench, datapath string) (Samples, bool) {
	for _, s := range set.Samples {
		if s.Bench == bench && (datapath == "" || s.Datapath == datapath) {
			return s, true
		}
	}
	return Samples{}, false
}
