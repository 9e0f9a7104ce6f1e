package k8s

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// --- the CNI plugins' execs, seen by the kernel's process events ---

// cniExec is one CNI plugin process: which plugin, for which sandbox
// (CNI_CONTAINERID) and command, and when it was forked, exec'd and
// exited (wall clock).
type cniExec struct {
	plugin, command, container string
	fork, exec, exit           time.Time
	// The process as taskstats names its tasks: its ID, its parent's and
	// its name (comm: an iptables symlink's name, not its target's).
	pid, ppid uint32
	comm      string
}

// took is the process's life: from its fork by the runtime (or by the
// plugin that delegates to it) to its exit.
func (e cniExec) took() time.Duration {
	if e.fork.IsZero() {
		return e.exit.Sub(e.exec)
	}
	return e.exit.Sub(e.fork)
}

// procWatch listens to the kernel's process events (the proc connector:
// fork, exec and exit of every process) and keeps the CNI plugins' execs:
// a process whose environment names a CNI_COMMAND: the plugins the
// runtime runs, the plugins they delegate to (bridge runs host-local),
// and what they run in turn (portmap's iptables). Nothing is added to the plugins or to the
// runtime: what is timed is the installed chain as the runtime runs it.
type procWatch struct {
	nl     *nlListener
	offset time.Duration // wall clock minus CLOCK_MONOTONIC
	mu     sync.Mutex
	forks  map[uint32]time.Time // processes (not threads) forked, until they exit
	live   map[uint32]*cniExec
	done   []cniExec
}

const (
	cnIdxProc         = 1
	cnValProc         = 1
	procCnMcastListen = 1
	procEventFork     = 0x00000001
	procEventExec     = 0x00000002
	procEventExit     = 0x80000000
)

func startProcWatch() (*procWatch, error) {
	l, err := openNetlink(unix.SOCK_DGRAM, unix.NETLINK_CONNECTOR, uint32(os.Getpid()), cnIdxProc)
	if err != nil {
		return nil, fmt.Errorf("proc connector: %w", err)
	}
	// nlmsghdr, cn_msg{id{idx, val}, seq, ack, len, flags}, op.
	msg := make([]byte, unix.SizeofNlMsghdr+20+4)
	le := binary.LittleEndian
	le.PutUint32(msg[0:], uint32(len(msg)))
	le.PutUint16(msg[4:], unix.NLMSG_DONE)
	le.PutUint32(msg[12:], uint32(os.Getpid()))
	le.PutUint32(msg[16:], cnIdxProc)
	le.PutUint32(msg[20:], cnValProc)
	le.PutUint16(msg[32:], 4)
	le.PutUint32(msg[36:], procCnMcastListen)
	if err := l.send(msg); err != nil {
		l.discard()
		return nil, fmt.Errorf("proc connector listen: %w", err)
	}
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		l.discard()
		return nil, err
	}
	w := &procWatch{nl: l, offset: time.Duration(time.Now().UnixNano() - ts.Nano()),
		forks: map[uint32]time.Time{}, live: map[uint32]*cniExec{}}
	l.listen(func(m syscall.NetlinkMessage) {
		if len(m.Data) >= 20 {
			w.event(m.Data[20:]) // after the cn_msg
		}
	})
	return w, nil
}

func (w *procWatch) close() { w.nl.close() }

// event is one proc_event: what, cpu, timestamp_ns, then its data.
func (w *procWatch) event(ev []byte) {
	if len(ev) < 16+8 {
		return
	}
	le := binary.LittleEndian
	what := le.Uint32(ev)
	at := time.Unix(0, int64(le.Uint64(ev[8:]))+int64(w.offset))
	d := ev[16:]
	switch what {
	case procEventFork:
		if len(d) < 16 {
			return
		}
		child, childTgid := le.Uint32(d[8:]), le.Uint32(d[12:])
		if child == childTgid {
			w.mu.Lock()
			w.forks[child] = at
			w.mu.Unlock()
		}
	case procEventExec:
		pid := le.Uint32(d)
		env, err := os.ReadFile("/proc/" + strconv.Itoa(int(pid)) + "/environ")
		if err != nil || !bytes.Contains(env, []byte("CNI_COMMAND=")) {
			return
		}
		exe, err := os.Readlink("/proc/" + strconv.Itoa(int(pid)) + "/exe")
		if err != nil {
			return
		}
		e := &cniExec{plugin: filepath.Base(exe), exec: at, pid: pid}
		if st, err := os.ReadFile("/proc/" + strconv.Itoa(int(pid)) + "/stat"); err == nil {
			if p, ok := parseProcStat(st); ok {
				e.ppid, e.comm = p.ppid, p.comm
			}
		}
		for _, kv := range bytes.Split(env, []byte{0}) {
			if k, v, ok := strings.Cut(string(kv), "="); ok {
				switch k {
				case "CNI_COMMAND":
					e.command = v
				case "CNI_CONTAINERID":
					e.container = v
				}
			}
		}
		if e.command == "" {
			return
		}
		w.mu.Lock()
		e.fork = w.forks[pid]
		w.live[pid] = e
		w.mu.Unlock()
	case procEventExit:
		if len(d) < 8 || le.Uint32(d) != le.Uint32(d[4:]) {
			return // a thread
		}
		pid := le.Uint32(d)
		w.mu.Lock()
		delete(w.forks, pid)
		if e, ok := w.live[pid]; ok {
			e.exit = at
			w.done = append(w.done, *e)
			delete(w.live, pid)
		}
		w.mu.Unlock()
	}
}

// execsOf returns the finished execs of command for each of the
// containers (sandbox IDs).
func (w *procWatch) execsOf(command string, containers map[string]bool) map[string][]cniExec {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := map[string][]cniExec{}
	for _, e := range w.done {
		if e.command == command && containers[e.container] {
			out[e.container] = append(out[e.container], e)
		}
	}
	return out
}

// execsSince returns the finished ADD execs that began in [from, to], by
// container (sandbox ID).
func (w *procWatch) execsSince(from, to time.Time) map[string][]cniExec {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := map[string][]cniExec{}
	for _, e := range w.done {
		if e.command == "ADD" && !e.exec.Before(from) && !e.exec.After(to) {
			out[e.container] = append(out[e.container], e)
		}
	}
	return out
}
