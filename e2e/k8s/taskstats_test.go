package k8s

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"os"
	"sync"
	"syscall"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"
)

// --- the CPU of processes that exit: the kernel's taskstats ---

// A plugin exec lives a few ms and is gone before /proc can be read. The
// kernel's taskstats (generic netlink, family TASKSTATS) sends, for every
// task (thread) that exits on the CPUs registered for, its accounting:
// its name and parent, its CPU time, and how long it waited on a run
// queue. Summed by name, that is what each short-lived program of a burst
// cost (the plugins, iptables, runc), beside what long-lived ones cost
// (/proc).

// taskKey names the tasks that exit: their name and their parent
// process. A thread's parent is its process's parent, so the threads of a
// live process have the key the process itself has (procCPU's comm and
// ppid), and are counted with it, not again.
type taskKey struct {
	comm string
	ppid uint32
}

// exitCPU is what the exited tasks of one key spent.
type exitCPU struct {
	tasks    int
	cpu      time.Duration // on a CPU
	runDelay time.Duration // runnable, waiting for a CPU
}

type taskWatch struct {
	nl    *nlListener
	mu    sync.Mutex
	byKey map[taskKey]exitCPU
}

const (
	taskstatsCmdGet       = 1
	taskstatsCmdNew       = 2
	taskstatsRegisterCPUs = 3 // TASKSTATS_CMD_ATTR_REGISTER_CPUMASK
	taskstatsTypeStats    = 3
	taskstatsTypeAggrPID  = 4

	// struct taskstats (linux/taskstats.h, version 13 here). The kernel
	// only appends to it, so a field keeps its offset.
	tsCPUDelayTotal  = 24
	tsCPURunVirtual  = 72 // sum_exec_runtime, ns
	tsComm           = 80
	tsCommLen        = 32
	tsPPID           = 132
	tsUtime, tsStime = 152, 160 // us
	tsMinLen         = 168
)

func startTaskWatch() (*taskWatch, error) {
	family, err := netlink.GenlFamilyGet("TASKSTATS")
	if err != nil {
		return nil, fmt.Errorf("taskstats: %w", err)
	}
	cpus, err := os.ReadFile("/sys/devices/system/cpu/possible")
	if err != nil {
		return nil, err
	}
	l, err := openNetlink(unix.SOCK_RAW, unix.NETLINK_GENERIC, 0, 0)
	if err != nil {
		return nil, fmt.Errorf("taskstats: %w", err)
	}
	// Register this socket for the exits on every CPU.
	req := nl.NewNetlinkRequest(int(family.ID), 0)
	req.AddData(&nl.Genlmsg{Command: taskstatsCmdGet, Version: 1})
	req.AddData(nl.NewRtAttr(taskstatsRegisterCPUs, nl.ZeroTerminated(string(bytes.TrimSpace(cpus)))))
	if err := l.send(req.Serialize()); err != nil {
		l.discard()
		return nil, fmt.Errorf("taskstats register: %w", err)
	}
	w := &taskWatch{nl: l, byKey: map[taskKey]exitCPU{}}
	l.listen(func(m syscall.NetlinkMessage) {
		if m.Header.Type == family.ID && len(m.Data) >= nl.SizeofGenlmsg && m.Data[0] == taskstatsCmdNew {
			w.message(m.Data[nl.SizeofGenlmsg:])
		}
	})
	return w, nil
}

func (w *taskWatch) close() { w.nl.close() }

// snapshot is the exited tasks' accounting so far.
func (w *taskWatch) snapshot() map[taskKey]exitCPU {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := make(map[taskKey]exitCPU, len(w.byKey))
	for k, v := range w.byKey {
		out[k] = v
	}
	return out
}

// message is one TASKSTATS_CMD_NEW: a task's (AGGR_PID) accounting, and
// for the last task of a group also the group's (AGGR_TGID), which is not
// counted again.
func (w *taskWatch) message(attrs []byte) {
	for _, a := range nlAttrs(attrs) {
		if a.Attr.Type&nl.NLA_TYPE_MASK != taskstatsTypeAggrPID {
			continue
		}
		for _, in := range nlAttrs(a.Value) {
			if in.Attr.Type&nl.NLA_TYPE_MASK != taskstatsTypeStats || len(in.Value) < tsMinLen {
				continue
			}
			k, cpu, delay := parseTaskstats(in.Value)
			w.mu.Lock()
			e := w.byKey[k]
			e.tasks++
			e.cpu += cpu
			e.runDelay += delay
			w.byKey[k] = e
			w.mu.Unlock()
		}
	}
}

// nlAttrs are a message's attributes; none where they do not parse.
func nlAttrs(b []byte) []syscall.NetlinkRouteAttr {
	attrs, err := nl.ParseRouteAttr(b)
	if err != nil {
		return nil
	}
	return attrs
}

// parseTaskstats reads a struct taskstats: the task's name and parent,
// its CPU time (sum_exec_runtime, or user plus system time where the
// scheduler's is not kept) and its wait on a run queue.
func parseTaskstats(s []byte) (taskKey, time.Duration, time.Duration) {
	le := binary.LittleEndian
	comm, _, _ := bytes.Cut(s[tsComm:tsComm+tsCommLen], []byte{0})
	cpu := time.Duration(le.Uint64(s[tsCPURunVirtual:]))
	if cpu == 0 {
		cpu = time.Duration(le.Uint64(s[tsUtime:])+le.Uint64(s[tsStime:])) * time.Microsecond
	}
	return taskKey{comm: string(comm), ppid: le.Uint32(s[tsPPID:])}, cpu, time.Duration(le.Uint64(s[tsCPUDelayTotal:]))
}
