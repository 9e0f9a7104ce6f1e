package cluster

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
	"syscall"
	"time"
)

// sysProcAttr makes the kernel SIGKILL a member when the thread that
// started it (the launcher's) ends, so a test binary killed by go test's
// timeout or by hand takes its members along.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}

// waitStopped waits until /proc shows process pid stopped (state T) or,
// with stopped false, not stopped; or until done is closed (it ended).
// Signal delivery is asynchronous; this is the event that says it landed.
func waitStopped(pid int, stopped bool, done <-chan struct{}) error {
	deadline := time.NewTimer(5 * time.Second)
	defer deadline.Stop()
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	for {
		f, err := statFields(pid)
		if err != nil {
			return err
		}
		if (string(f[0]) == "T") == stopped {
			return nil
		}
		select {
		case <-done:
			return fmt.Errorf("process %d ended", pid)
		case <-deadline.C:
			return fmt.Errorf("process %d: not stopped=%v after 5s", pid, stopped)
		case <-tick.C:
		}
	}
}

// clockTicks is the unit of /proc/<pid>/stat's CPU times (USER_HZ): 100
// on every Linux architecture Go supports.
const clockTicks = 100

// statFields are the fields of /proc/<pid>/stat after the command name
// (which is in parentheses and may hold spaces): f[0] is the stat's field
// 3, the state; f[11] and f[12] its fields 14 and 15, utime and stime.
func statFields(pid int) ([][]byte, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return nil, fmt.Errorf("read process stat: %w", err)
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return nil, fmt.Errorf("process %d: no command name in its stat", pid)
	}
	f := bytes.Fields(b[i+1:])
	if len(f) < 13 {
		return nil, fmt.Errorf("process %d: short stat", pid)
	}
	return f, nil
}

// processCPU is the CPU time process pid has used, user plus system.
func processCPU(pid int) (time.Duration, error) {
	f, err := statFields(pid)
	if err != nil {
		return 0, err
	}
	var ticks int64
	for _, s := range f[11:13] {
		n, err := strconv.ParseInt(string(s), 10, 64)
		if err != nil {
			return 0, fmt.Errorf("process %d: stat CPU time %q: %w", pid, s, err)
		}
		ticks += n
	}
	return time.Duration(ticks) * time.Second / clockTicks, nil
}

// processRSS is the resident memory of process pid, in bytes (VmRSS of
// /proc/<pid>/status).
func processRSS(pid int) (int64, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return 0, fmt.Errorf("read process status: %w", err)
	}
	for _, line := range bytes.Split(b, []byte("\n")) {
		if rest, ok := bytes.CutPrefix(line, []byte("VmRSS:")); ok {
			f := bytes.Fields(rest)
			if len(f) < 1 {
				break
			}
			kb, err := strconv.ParseInt(string(f[0]), 10, 64)
			if err != nil {
				return 0, fmt.Errorf("process %d: VmRSS %q: %w", pid, f[0], err)
			}
			return kb << 10, nil
		}
	}
	return 0, fmt.Errorf("process %d: no VmRSS in its status", pid)
}
