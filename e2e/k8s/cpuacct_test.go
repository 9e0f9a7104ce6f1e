package k8s

import (
	"bytes"
	"cmp"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"
)

// --- where a burst's CPU goes: the machine's and each program's ---

// On this machine a burst keeps both cores busy, so the CPU a network
// costs is time every other pod waits for. A cpuSnapshot is what the
// kernel has counted so far: all CPUs' busy time (/proc/stat), each live
// process's own time (/proc/PID/stat), and the exited tasks' time by name
// (taskstats: the plugin execs, iptables, runc).

// clockTicks is USER_HZ, the unit of /proc's CPU times (100 on Linux).
const clockTicks = 100

type cpuSnapshot struct {
	busy  time.Duration       // all CPUs, not idle or iowait
	procs map[int]procCPU     // by PID
	exits map[taskKey]exitCPU // nil without taskstats
}

type procCPU struct {
	comm  string
	ppid  uint32
	start uint64        // start time, ticks since boot: a PID reused is another process
	self  time.Duration // its threads', the exited ones' too
}

// takeCPUSnapshot reads /proc, and w's exited tasks when w is not nil.
func takeCPUSnapshot(w *taskWatch) (cpuSnapshot, error) {
	s := cpuSnapshot{procs: map[int]procCPU{}}
	if w != nil {
		s.exits = w.snapshot()
	}
	stat, err := os.ReadFile("/proc/stat")
	if err != nil {
		return s, err
	}
	line, _, _ := bytes.Cut(stat, []byte("\n"))
	f := strings.Fields(string(line))
	if len(f) < 8 || f[0] != "cpu" {
		return s, fmt.Errorf("/proc/stat: unexpected first line %q", line)
	}
	for i, v := range f[1:] {
		if i == 3 || i == 4 { // idle, iowait
			continue
		}
		if i >= 8 { // guest times are in user already
			break
		}
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			return s, fmt.Errorf("/proc/stat: %w", err)
		}
		s.busy += ticks(n)
	}
	dirs, err := filepath.Glob("/proc/[0-9]*")
	if err != nil {
		return s, err
	}
	for _, d := range dirs {
		pid, err := strconv.Atoi(filepath.Base(d))
		if err != nil {
			continue
		}
		b, err := os.ReadFile(d + "/stat")
		if err != nil {
			continue // gone meanwhile
		}
		if p, ok := parseProcStat(b); ok {
			s.procs[pid] = p
		}
	}
	return s, nil
}

func ticks(n uint64) time.Duration { return time.Duration(n) * time.Second / clockTicks }

// parseProcStat reads a /proc/PID/stat line: the name in parentheses
// (which may hold spaces and parentheses), then the parent (field 4),
// utime and stime (14 and 15) and starttime (22).
func parseProcStat(b []byte) (procCPU, bool) {
	open, end := bytes.IndexByte(b, '('), bytes.LastIndexByte(b, ')')
	if open < 0 || end < open {
		return procCPU{}, false
	}
	f := strings.Fields(string(b[end+1:]))
	// f[0] is field 3 (state), so field k is f[k-3].
	if len(f) < 20 {
		return procCPU{}, false
	}
	num := func(k int) uint64 {
		n, _ := strconv.ParseUint(f[k-3], 10, 64)
		return n
	}
	return procCPU{comm: string(b[open+1 : end]), ppid: uint32(num(4)), start: num(22), self: ticks(num(14) + num(15))}, true
}

// cpuDelta is what was spent between two snapshots: all CPUs' busy time,
// and by program name the live processes' own time (a process started
// meanwhile counts whole) plus the exited tasks' whose name and parent no
// process in either snapshot has (those are its threads, in its own time
// already). So a process that started and ended meanwhile counts whole
// (taskstats sends its whole life); one that ended meanwhile but was live
// at the first snapshot, or that shares its name and parent with a live
// one, is only in busy, as every ended process is without taskstats.
type cpuDelta struct {
	busy  time.Duration
	byCmd map[string]time.Duration
	// The exited tasks' wait on a run queue, by name.
	runDelay map[string]time.Duration
}

func diffCPU(a, b cpuSnapshot) cpuDelta {
	d := cpuDelta{busy: b.busy - a.busy, byCmd: map[string]time.Duration{}, runDelay: map[string]time.Duration{}}
	live := map[taskKey]bool{}
	for _, s := range []cpuSnapshot{a, b} {
		for _, p := range s.procs {
			live[taskKey{comm: p.comm, ppid: p.ppid}] = true
		}
	}
	for pid, p := range b.procs {
		was, ok := a.procs[pid]
		if !ok || was.start != p.start {
			was = procCPU{}
		}
		if x := p.self - was.self; x > 0 {
			d.byCmd[p.comm] += x
		}
	}
	for k, v := range b.exits {
		if was := a.exits[k]; v.tasks > was.tasks && !live[k] {
			d.byCmd[k.comm] += v.cpu - was.cpu
			d.runDelay[k.comm] += v.runDelay - was.runDelay
		}
	}
	return d
}

// cpuStats pools a network's bursts' CPU over the rounds.
type cpuStats struct {
	bursts   int
	busy     time.Duration
	byCmd    map[string]time.Duration
	runDelay map[string]time.Duration
}

func (s *cpuStats) add(d cpuDelta) {
	s.bursts++
	s.busy += d.busy
	if s.byCmd == nil {
		s.byCmd, s.runDelay = map[string]time.Duration{}, map[string]time.Duration{}
	}
	for k, v := range d.byCmd {
		s.byCmd[k] += v
	}
	for k, v := range d.runDelay {
		s.runDelay[k] += v
	}
}

// meanBusy is a burst's busy CPU time, the mean over the rounds.
func (s *cpuStats) meanBusy() time.Duration {
	if s == nil || s.bursts == 0 {
		return 0
	}
	return s.busy / time.Duration(s.bursts)
}

// perPod is a program's CPU in a burst of n pods, per pod, in ms (the
// mean over the rounds).
func (s *cpuStats) perPod(name string, n int) float64 {
	if s == nil || s.bursts == 0 || n == 0 {
		return 0
	}
	return ms(s.byCmd[name]) / float64(s.bursts*n)
}

// top names the programs that took the most CPU in a burst of n pods, in
// ms per pod, at most k of them, the rest summed; for an exited program,
// also its run-queue wait.
func (s *cpuStats) top(k, n int) string {
	if s == nil || s.bursts == 0 {
		return ""
	}
	var parts []string
	var rest float64
	for i, name := range mostFirst(s.byCmd) {
		v := s.perPod(name, n)
		switch {
		case i >= k:
			rest += v
		case s.runDelay[name] > 0:
			parts = append(parts, fmt.Sprintf("%s %.1f (waited %.1f)", name, v, ms(s.runDelay[name])/float64(s.bursts*n)))
		default:
			parts = append(parts, fmt.Sprintf("%s %.1f", name, v))
		}
	}
	if rest > 0 {
		parts = append(parts, fmt.Sprintf("others %.1f", rest))
	}
	return strings.Join(parts, ", ")
}

// aboveFloor is, by program, what a burst of n pods on this network cost
// per pod beyond the host-network floor's burst, in ms, and the sum.
func (s *cpuStats) aboveFloor(floor *cpuStats, n int) (map[string]float64, float64) {
	out := map[string]float64{}
	var sum float64
	for _, m := range []map[string]time.Duration{s.byCmd, floor.byCmd} {
		for name := range m {
			if _, done := out[name]; !done {
				out[name] = s.perPod(name, n) - floor.perPod(name, n)
				sum += out[name]
			}
		}
	}
	return out, sum
}

// describeAbove lists the programs whose CPU per pod differs from the
// floor's by at least 0.5 ms, most first.
func describeAbove(above map[string]float64) string {
	var parts []string
	for _, name := range mostFirst(above) {
		if v := above[name]; v >= 0.5 || v <= -0.5 {
			parts = append(parts, fmt.Sprintf("%s %+.1f", name, v))
		}
	}
	return strings.Join(parts, ", ")
}

// mostFirst is m's names, the largest value first (ties by name).
func mostFirst[V cmp.Ordered](m map[string]V) []string {
	names := slices.Collect(maps.Keys(m))
	slices.SortFunc(names, func(x, y string) int {
		if c := cmp.Compare(m[y], m[x]); c != 0 {
			return c
		}
		return strings.Compare(x, y)
	})
	return names
}
