package locktrace

import (
	"cmp"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Report is what a Trace saw: every wait for a contended mutex.
type Report struct {
	// Window is how long the trace recorded; Lost how many events the
	// kernel dropped (a full buffer), which makes the sums too small.
	Window time.Duration
	Lost   int
	Waits  []Wait
	// Unended counts waits whose end was not recorded (still waiting when
	// the trace stopped, or lost).
	Unended int
}

// Wait is one task's wait for one mutex.
type Wait struct {
	Comm       string
	PID        int
	Lock       string // the lock's address as the trace prints it (hashed)
	Site       string // the function that asked for the lock
	Stack      []string
	Start, End time.Duration // trace clock
	// RTNL: the lock is rtnl. The lock's address is hashed, so this is
	// learnt from the sites: a lock that rtnetlink asked for (in
	// rtnetlink_rcv_msg, rtnl_newlink or rtnl_lock) in any wait of the
	// trace is rtnl in every wait, also where the site is a caller of an
	// inlined rtnl_lock (linkwatch_event, for one).
	RTNL bool
}

// Duration is how long the task waited.
func (w Wait) Duration() time.Duration { return w.End - w.Start }

// rtnlSite reports whether site is rtnetlink's.
func rtnlSite(site string) bool {
	return strings.HasPrefix(site, "rtnl") || strings.HasPrefix(site, "rtnetlink") || strings.HasPrefix(site, "__rtnl")
}

// IsRTNL keeps the waits for rtnl.
func IsRTNL(w Wait) bool { return w.RTNL }

// eventLine is an event of the trace file: "<comm>-<pid> [cpu] <flags>
// <seconds>: <event>: <lock address> (...)".
var eventLine = regexp.MustCompile(`^\s*(.+)-(\d+)\s+\[\d+\]\s+\S+\s+(\d+\.\d+): (contention_begin|contention_end): (\S+)`)

// mutexFrame reports whether f is one of the frames of the stack between
// the event and the function that took the lock.
func mutexFrame(f string) bool {
	for _, p := range []string{"trace_event_raw_event_", "__traceiter_", "__mutex_lock", "mutex_lock", "__pfx_"} {
		if strings.HasPrefix(f, p) {
			return true
		}
	}
	return false
}

// Parse reads a trace file of contention_begin (with stack traces) and
// contention_end events.
func Parse(text string) *Report {
	r := &Report{}
	open := map[int]*Wait{} // by pid
	var stackOf *Wait       // the wait whose stack lines follow
	for _, line := range strings.Split(text, "\n") {
		if f, ok := strings.CutPrefix(strings.TrimSpace(line), "=> "); ok {
			if stackOf != nil {
				stackOf.Stack = append(stackOf.Stack, f)
				if stackOf.Site == "" && !mutexFrame(f) {
					stackOf.Site = f
				}
			}
			continue
		}
		if strings.Contains(line, "<stack trace>") {
			continue
		}
		stackOf = nil
		m := eventLine.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		pid, _ := strconv.Atoi(m[2])
		secs, _ := strconv.ParseFloat(m[3], 64)
		at := time.Duration(secs * float64(time.Second))
		switch w := open[pid]; {
		case m[4] == "contention_begin" && w == nil:
			w = &Wait{Comm: strings.TrimSpace(m[1]), PID: pid, Lock: m[5], Start: at}
			open[pid] = w
			stackOf = w
		case m[4] == "contention_begin":
			// A spin that turned into a sleep: the same wait.
		case w != nil && w.Lock == m[5]:
			w.End = at
			r.Waits = append(r.Waits, *w)
			delete(open, pid)
		}
	}
	r.Unended = len(open)
	rtnl := map[string]bool{}
	for _, w := range r.Waits {
		if rtnlSite(w.Site) {
			rtnl[w.Lock] = true
		}
	}
	for i := range r.Waits {
		r.Waits[i].RTNL = rtnl[r.Waits[i].Lock]
	}
	return r
}

// Total sums the waits that keep says to.
func (r *Report) Total(keep func(Wait) bool) (n int, d time.Duration) {
	for _, w := range r.Waits {
		if keep(w) {
			n++
			d += w.Duration()
		}
	}
	return n, d
}

// Busy is how long, within the trace, at least one task waited among the
// waits keep says to: for one lock, how long it was a queue.
func (r *Report) Busy(keep func(Wait) bool) time.Duration {
	var iv [][2]time.Duration
	for _, w := range r.Waits {
		if keep(w) {
			iv = append(iv, [2]time.Duration{w.Start, w.End})
		}
	}
	slices.SortFunc(iv, func(a, b [2]time.Duration) int { return cmp.Compare(a[0], b[0]) })
	var sum, end time.Duration
	for i, v := range iv {
		if i == 0 || v[0] > end {
			sum += v[1] - v[0]
			end = v[1]
		} else if v[1] > end {
			sum += v[1] - end
			end = v[1]
		}
	}
	return sum
}

// By sums the waits keep says to by key, largest first.
func (r *Report) By(keep func(Wait) bool, key func(Wait) string) []Sum {
	sums := map[string]*Sum{}
	for _, w := range r.Waits {
		if !keep(w) {
			continue
		}
		k := key(w)
		s := sums[k]
		if s == nil {
			s = &Sum{Key: k}
			sums[k] = s
		}
		s.N++
		s.Wait += w.Duration()
	}
	var out []Sum
	for _, s := range sums {
		out = append(out, *s)
	}
	slices.SortFunc(out, func(a, b Sum) int { return cmp.Or(cmp.Compare(b.Wait, a.Wait), cmp.Compare(a.Key, b.Key)) })
	return out
}

// Sum is the waits of one key.
type Sum struct {
	Key  string
	N    int
	Wait time.Duration
}

func (s Sum) String() string {
	return fmt.Sprintf("%s %d waits %v", s.Key, s.N, s.Wait.Round(time.Millisecond))
}

// All keeps every wait.
func All(Wait) bool { return true }

// Summary says, for rtnl and for the other mutexes, how many waits, how
// long in all, how long the lock had a queue against the window, and the
// largest waiters by command and by site.
func (r *Report) Summary() string {
	var b strings.Builder
	for _, g := range []struct {
		name string
		keep func(Wait) bool
	}{{"rtnl", IsRTNL}, {"other mutexes", func(w Wait) bool { return !w.RTNL }}} {
		n, d := r.Total(g.keep)
		fmt.Fprintf(&b, "%s: %d waits, %v in all, a queue %v of the %v traced; by command %v; by site %v\n",
			g.name, n, d.Round(time.Millisecond), r.Busy(g.keep).Round(time.Millisecond), r.Window.Round(time.Millisecond),
			top(r.By(g.keep, func(w Wait) string { return w.Comm }), 4), top(r.By(g.keep, func(w Wait) string { return cmp.Or(w.Site, "(no stack)") }), 4))
	}
	if r.Lost > 0 || r.Unended > 0 {
		fmt.Fprintf(&b, "incomplete: %d events lost, %d waits without an end\n", r.Lost, r.Unended)
	}
	return b.String()
}

func top(s []Sum, n int) []Sum { return s[:min(n, len(s))] }
