// Package benchreport turns the output of `make bench` (go test -bench,
// one file per command) into the project's benchmark report: each named
// figure beside the baseline it was measured against in the same run.
package benchreport

import (
	"bufio"
	"io"
	"strconv"
	"strings"
)

// Result is one benchmark line: its name without the GOMAXPROCS suffix
// (BenchmarkAddDel/concurrency=1) and its metrics by unit.
type Result struct {
	Name    string
	Metrics map[string]float64
}

// Parse reads go test -bench output and returns its benchmark lines, in
// order. Other lines are skipped.
func Parse(r io.Reader) ([]Result, error) {
	var out []Result
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 4 || !strings.HasPrefix(f[0], "Benchmark") {
			continue
		}
		if _, err := strconv.Atoi(f[1]); err != nil {
			continue // not a result line (a log line that starts alike)
		}
		res := Result{Name: trimProcs(f[0]), Metrics: map[string]float64{}}
		for i := 2; i+1 < len(f); i += 2 {
			v, err := strconv.ParseFloat(f[i], 64)
			if err != nil {
				break
			}
			res.Metrics[f[i+1]] = v
		}
		out = append(out, res)
	}
	return out, sc.Err()
}

// trimProcs drops the -N GOMAXPROCS suffix go test appends.
func trimProcs(name string) string {
	i := strings.LastIndexByte(name, '-')
	if i < 0 {
		return name
	}
	if _, err := strconv.Atoi(name[i+1:]); err != nil {
		return name
	}
	return name[:i]
}
