package nodealloc_test

import (
	"flag"
	"fmt"
	"hash/fnv"
	"strings"
	"time"
)

// The model run's trace, its replay command, its awaits and its nodes'
// logs: what both backends share besides the model itself.

// modelTrace is every line the run logs (each step's operation, its
// arguments, its faults and its answers), hashed as it goes; kept whole
// when keep is set (TestModelSimulatedReplays compares two runs' lines).
type modelTrace struct {
	h     uint64
	n     int
	keep  bool
	lines []string
}

func (t *modelTrace) add(line string) {
	f := fnv.New64a()
	fmt.Fprintf(f, "%016x\n%s", t.h, line)
	t.h = f.Sum64()
	t.n++
	if t.keep {
		t.lines = append(t.lines, line)
	}
}

func (t *modelTrace) sum() uint64 { return t.h }

// firstDiff is the first line where two kept traces differ, with the
// lines before it, "" if none.
func firstDiff(a, b []string) string {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return fmt.Sprintf("line %d, after\n    %s\n  first:  %s\n  second: %s", i, strings.Join(a[max(0, i-12):i], "\n    "), a[i], b[i])
		}
	}
	if len(a) != len(b) {
		return fmt.Sprintf("one trace ends at line %d, the other has %d lines", min(len(a), len(b)), max(len(a), len(b)))
	}
	return ""
}

// replayCommand is the one line that runs this run again, to the step it
// stopped at, with every -model flag that differs from its default.
func (r *modelRun) replayCommand() string {
	test := strings.SplitN(r.name, "/", 2)[0]
	if test == "TestModelSimulatedReplays" {
		test = "TestModelSimulated" // the same run, once
	}
	args := []string{"go test ./allocator/nodealloc -run '" + test + "$'",
		fmt.Sprintf("-model.seed=%d", r.seed), fmt.Sprintf("-model.steps=%d", r.step+1)}
	flag.Visit(func(f *flag.Flag) {
		if strings.HasPrefix(f.Name, "model.") && f.Name != "model.seed" && f.Name != "model.steps" {
			args = append(args, fmt.Sprintf("-%s=%s", f.Name, f.Value))
		}
	})
	return strings.Join(args, " ")
}

// await polls cond until it holds, letting time pass between polls (the
// fake clock's in the simulation), for at most limit.
func (r *modelRun) await(limit time.Duration, cond func() bool) bool {
	end := r.b.now().Add(limit)
	for !cond() {
		if r.b.now().After(end) {
			return false
		}
		r.b.sleep(r.b.pollEvery())
	}
	return true
}

// nodeLogKeep is how much of each node allocator's log a run keeps: the
// end of it, for a report (a long run's whole log would not fit).
const nodeLogKeep = 1 << 20

// logRing keeps the last bytes written to it, about max of them.
type logRing struct {
	buf []byte
	max int
}

func newLogRing(max int) *logRing { return &logRing{max: max} }

func (l *logRing) Write(p []byte) (int, error) {
	l.buf = append(l.buf, p...)
	if len(l.buf) > 2*l.max {
		l.buf = append(l.buf[:0], l.buf[len(l.buf)-l.max:]...)
	}
	return len(p), nil
}

func (l *logRing) String() string { return string(l.buf) }
