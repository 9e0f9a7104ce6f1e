// Package locktrace records which kernel mutexes a stretch of work waited
// for, how long and where, from the kernel's lock:contention_begin and
// lock:contention_end trace events (tracefs, root). Benchmarks use it to
// say where a burst of CNI ADDs queues: on rtnl, on an RCU grace period,
// or elsewhere.
//
// A Trace records in its own tracefs instance (its own buffer), so it
// neither sees nor disturbs other tracing on the machine.
package locktrace

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// Root is where tracefs is mounted.
const Root = "/sys/kernel/tracing"

// ErrUnsupported: the kernel has no tracefs or no lock contention events
// (they need CONFIG_TRACEPOINTS; 5.19 or later).
var ErrUnsupported = errors.New("locktrace: no tracefs lock contention events")

// Trace is one recording, from Start to Stop.
type Trace struct {
	dir   string
	began time.Time
	// mounted: Start mounted tracefs, and removing the instance unmounts it.
	mounted bool
}

// mutexFlag is LCB_F_MUTEX of contention_begin's flags: a sleeping mutex
// (rtnl, the RCU expedited funnel), as opposed to spinlocks and rwsems.
const mutexFlag = 32

// Start begins recording mutex contention, with the kernel stack of each
// wait's start, in a new tracefs instance of name (unique per process).
func Start(name string) (*Trace, error) {
	t := &Trace{dir: filepath.Join(Root, "instances", fmt.Sprintf("%s-%d", name, os.Getpid()))}
	if _, err := os.Stat(filepath.Join(Root, "events")); err != nil {
		// Not mounted (a minimal host): mount it for this trace.
		if err := unix.Mount("nodev", Root, "tracefs", 0, ""); err != nil {
			return nil, fmt.Errorf("%w: mount tracefs on %s: %v", ErrUnsupported, Root, err)
		}
		t.mounted = true
	}
	if _, err := os.Stat(filepath.Join(Root, "events/lock/contention_begin")); err != nil {
		return nil, errors.Join(fmt.Errorf("%w: %v", ErrUnsupported, err), t.unmount())
	}
	if err := os.Mkdir(t.dir, 0o755); err != nil {
		return nil, errors.Join(fmt.Errorf("create tracefs instance: %w", err), t.unmount())
	}
	writes := [][2]string{
		{"buffer_size_kb", "32768"},
		{"events/lock/contention_begin/filter", fmt.Sprintf("flags & %d", mutexFlag)},
		{"events/lock/contention_begin/trigger", fmt.Sprintf("stacktrace if flags & %d", mutexFlag)},
		{"events/lock/contention_begin/enable", "1"},
		{"events/lock/contention_end/enable", "1"},
		{"tracing_on", "1"},
	}
	for _, w := range writes {
		if err := os.WriteFile(filepath.Join(t.dir, w[0]), []byte(w[1]), 0); err != nil {
			return nil, errors.Join(fmt.Errorf("tracefs %s: %w", w[0], err), t.remove())
		}
	}
	t.began = time.Now()
	return t, nil
}

// Stop ends the recording, removes the instance and returns what it saw.
func (t *Trace) Stop() (*Report, error) {
	window := time.Since(t.began)
	if err := os.WriteFile(filepath.Join(t.dir, "tracing_on"), []byte("0"), 0); err != nil {
		return nil, errors.Join(fmt.Errorf("stop tracing: %w", err), t.remove())
	}
	text, err := os.ReadFile(filepath.Join(t.dir, "trace"))
	lost := t.overruns()
	if rerr := t.remove(); err == nil {
		err = rerr
	}
	if err != nil {
		return nil, fmt.Errorf("read the trace: %w", err)
	}
	r := Parse(string(text))
	r.Window, r.Lost = window, lost
	return r, nil
}

// overruns is how many events the instance's buffers dropped.
func (t *Trace) overruns() int {
	n := 0
	cpus, _ := filepath.Glob(filepath.Join(t.dir, "per_cpu/cpu*/stats"))
	for _, p := range cpus {
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "overrun: "); ok {
				k, _ := strconv.Atoi(strings.TrimSpace(v))
				n += k
			}
		}
	}
	return n
}

// remove turns the instance's events off (an instance with a trigger set
// cannot be removed) and removes it.
func (t *Trace) remove() error {
	for _, w := range [][2]string{
		{"events/lock/contention_begin/enable", "0"},
		{"events/lock/contention_end/enable", "0"},
		{"events/lock/contention_begin/trigger", fmt.Sprintf("!stacktrace if flags & %d", mutexFlag)},
	} {
		_ = os.WriteFile(filepath.Join(t.dir, w[0]), []byte(w[1]), 0)
	}
	if err := os.Remove(t.dir); err != nil {
		return errors.Join(fmt.Errorf("remove tracefs instance: %w", err), t.unmount())
	}
	return t.unmount()
}

// unmount unmounts tracefs if Start mounted it.
func (t *Trace) unmount() error {
	if !t.mounted {
		return nil
	}
	if err := unix.Unmount(Root, 0); err != nil {
		return fmt.Errorf("unmount tracefs: %w", err)
	}
	return nil
}
