package k8s

import (
	"errors"
	"os"
	"os/exec"
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// TestProcStatParse: the name may hold spaces and parentheses; the CPU
// fields are read after the last one.
func TestProcStatParse(t *testing.T) {
	line := "4242 (a) b (c)) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 50 7 3 20 0 1 0 98765 1000 10 18446744073709551615 0 0 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0\n"
	p, ok := parseProcStat([]byte(line))
	require.True(t, ok)
	require.Equal(t, "a) b (c)", p.comm)
	require.Equal(t, uint32(1), p.ppid)
	require.Equal(t, uint64(98765), p.start)
	require.Equal(t, 3*time.Second, p.self)
	_, ok = parseProcStat([]byte("12 (x) S 1"))
	require.False(t, ok)
}

// TestCPUDeltaCountsExitedProcesses (root: taskstats): a child that spins
// and exits between two snapshots shows under its name, from the kernel's
// taskstats, with about the CPU it took (its own rusage), and the
// machine's busy time covers it.
func TestCPUDeltaCountsExitedProcesses(t *testing.T) {
	w := taskWatchT(t)
	a, err := takeCPUSnapshot(w)
	require.NoError(t, err)
	// A copy of sh under a name of its own.
	spin := t.TempDir() + "/kvipam-spin"
	sh, err := exec.LookPath("sh")
	require.NoError(t, err)
	b0, err := os.ReadFile(sh)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(spin, b0, 0o755))
	cmd := exec.Command(spin, "-c", "i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done")
	require.NoError(t, cmd.Run())
	took := cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime()
	var d cpuDelta
	// The exit's message may trail the wait: await it.
	require.Eventually(t, func() bool {
		b, err := takeCPUSnapshot(w)
		require.NoError(t, err)
		d = diffCPU(a, b)
		return d.byCmd["kvipam-spin"] > 0
	}, time.Minute, 10*time.Millisecond, "no exit accounting for kvipam-spin")
	require.InDelta(t, took.Seconds(), d.byCmd["kvipam-spin"].Seconds(), 0.05+0.1*took.Seconds(), "taskstats against rusage")
	require.GreaterOrEqual(t, d.busy, d.byCmd["kvipam-spin"]-20*time.Millisecond)
}

// TestCPUDeltaCountsAThreadOnce (root: taskstats): a thread of a live
// process that spins and exits is in the process's own time (/proc) and
// in the kernel's exit accounting (taskstats): counted once.
func TestCPUDeltaCountsAThreadOnce(t *testing.T) {
	w := taskWatchT(t)
	a, err := takeCPUSnapshot(w)
	require.NoError(t, err)
	before := w.snapshot()
	spun := spinThreadAndEnd(300 * time.Millisecond)
	self := ""
	// Await the thread's exit accounting.
	require.Eventually(t, func() bool {
		for k, v := range w.snapshot() {
			if v.cpu-before[k].cpu >= spun {
				self = k.comm
				return true
			}
		}
		return false
	}, time.Minute, 10*time.Millisecond, "no exit accounting for the spinning thread")
	b, err := takeCPUSnapshot(w)
	require.NoError(t, err)
	d := diffCPU(a, b)
	require.Equal(t, b.procs[os.Getpid()].comm, self)
	require.Less(t, d.byCmd[self], spun*3/2, "the thread's %v counted twice: %v", spun, d.byCmd[self])
	require.GreaterOrEqual(t, d.byCmd[self], spun-20*time.Millisecond)
}

// spinThreadAndEnd spins a thread of this process for d of its CPU time,
// then ends the thread, and returns the CPU time spun. A goroutine that
// ends locked to its thread ends the thread too, unless the thread is the
// process's main thread, which Go never ends: a goroutine that lands
// there holds it until the spin is done, so that the next one lands
// elsewhere.
func spinThreadAndEnd(d time.Duration) time.Duration {
	release := make(chan struct{})
	defer close(release)
	for {
		res := make(chan time.Duration, 1) // -1: on the main thread
		go func() {
			runtime.LockOSThread()
			if unix.Gettid() == os.Getpid() {
				res <- -1
				<-release
				runtime.UnlockOSThread()
				return
			}
			var ts unix.Timespec
			start := threadCPU(&ts)
			for threadCPU(&ts)-start < d {
			}
			res <- threadCPU(&ts) - start
		}()
		if spun := <-res; spun >= 0 {
			return spun
		}
	}
}

func threadCPU(ts *unix.Timespec) time.Duration {
	_ = unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, ts)
	return time.Duration(ts.Nano())
}

// taskWatchT starts a taskstats listener for t, closed at its end; it
// skips t when not root or on a kernel without taskstats.
func taskWatchT(t *testing.T) *taskWatch {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("taskstats registration needs root (CAP_NET_ADMIN)")
	}
	w, err := startTaskWatch()
	if errors.Is(err, unix.ENOENT) {
		t.Skipf("this kernel has no taskstats (CONFIG_TASKSTATS): %v", err)
	}
	require.NoError(t, err)
	t.Cleanup(w.close)
	return w
}

// TestCPUAboveFloor: a network's CPU per pod less the floor's, for every
// program either has, most first.
func TestCPUAboveFloor(t *testing.T) {
	var net, floor cpuStats
	net.add(cpuDelta{busy: 4 * time.Second, byCmd: map[string]time.Duration{"a": 2 * time.Second, "b": time.Second}})
	floor.add(cpuDelta{busy: 2 * time.Second, byCmd: map[string]time.Duration{"a": time.Second, "c": time.Second / 2}})
	above, sum := net.aboveFloor(&floor, 10)
	require.Equal(t, map[string]float64{"a": 100, "b": 100, "c": -50}, above)
	require.InDelta(t, 150, sum, 1e-9)
	require.Equal(t, "a +100.0, b +100.0, c -50.0", describeAbove(above))
	require.Equal(t, "a 200.0, b 100.0", net.top(2, 10))
	require.Equal(t, "a 200.0, others 100.0", net.top(1, 10))
}
