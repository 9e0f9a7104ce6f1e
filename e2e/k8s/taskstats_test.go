package k8s

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"os"
	"sync"
	"time"

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
	genlIDCtrl            = 0x10
	ctrlCmdGetFamily      = 3
	ctrlAttrFamilyID      = 1
	ctrlAttrFamilyName    = 2
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
	genlHdrLen       = 4
	nlaHdrLen        = 4
)

func startTaskWatch() (*taskWatch, error) {
	l, err := openNetlink(unix.SOCK_RAW, unix.NETLINK_GENERIC, 0, 0)
	if err != nil {
		return nil, fmt.Errorf("taskstats: %w", err)
	}
	family, err := genlFamily(l, "TASKSTATS")
	if err != nil {
		l.discard()
		return nil, err
	}
	cpus, err := os.ReadFile("/sys/devices/system/cpu/possible")
	if err != nil {
		l.discard()
		return nil, err
	}
	if err := genlSend(l.fd, family, taskstatsCmdGet, taskstatsRegisterCPUs, append(bytes.TrimSpace(cpus), 0)); err != nil {
		l.discard()
		return nil, fmt.Errorf("taskstats register: %w", err)
	}
	w := &taskWatch{nl: l, byKey: map[taskKey]exitCPU{}}
	le := binary.LittleEndian
	l.listen(func(m []byte) {
		if le.Uint16(m[4:]) == family && len(m) >= nlmsgHdrLen+genlHdrLen && m[nlmsgHdrLen] == taskstatsCmdNew {
			w.message(m[nlmsgHdrLen+genlHdrLen:])
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
		if a.typ != taskstatsTypeAggrPID {
			continue
		}
		for _, in := range nlAttrs(a.data) {
			if in.typ != taskstatsTypeStats || len(in.data) < tsMinLen {
				continue
			}
			k, cpu, delay := parseTaskstats(in.data)
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

type nlAttr struct {
	typ  uint16
	data []byte
}

func nlAttrs(b []byte) []nlAttr {
	le := binary.LittleEndian
	var out []nlAttr
	for len(b) >= nlaHdrLen {
		l := int(le.Uint16(b))
		if l < nlaHdrLen || l > len(b) {
			break
		}
		out = append(out, nlAttr{typ: le.Uint16(b[2:]) &^ (unix.NLA_F_NESTED | unix.NLA_F_NET_BYTEORDER), data: b[nlaHdrLen:l]})
		b = b[min((l+3)&^3, len(b)):]
	}
	return out
}

// genlSend sends a generic netlink request of one attribute.
func genlSend(fd int, family uint16, cmd uint8, attr uint16, val []byte) error {
	le := binary.LittleEndian
	alen := nlaHdrLen + len(val)
	msg := make([]byte, nlmsgHdrLen+genlHdrLen+(alen+3)&^3)
	le.PutUint32(msg[0:], uint32(len(msg)))
	le.PutUint16(msg[4:], family)
	le.PutUint16(msg[6:], unix.NLM_F_REQUEST)
	msg[nlmsgHdrLen] = cmd
	msg[nlmsgHdrLen+1] = 1 // version
	a := msg[nlmsgHdrLen+genlHdrLen:]
	le.PutUint16(a, uint16(alen))
	le.PutUint16(a[2:], attr)
	copy(a[nlaHdrLen:], val)
	return unix.Sendto(fd, msg, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK})
}

// genlFamily resolves a generic netlink family's ID by name.
func genlFamily(l *nlListener, name string) (uint16, error) {
	if err := genlSend(l.fd, genlIDCtrl, ctrlCmdGetFamily, ctrlAttrFamilyName, append([]byte(name), 0)); err != nil {
		return 0, fmt.Errorf("genl family %s: %w", name, err)
	}
	buf := make([]byte, 1<<16)
	n, err := l.recv(buf)
	if err != nil {
		return 0, fmt.Errorf("genl family %s: %w", name, err)
	}
	le := binary.LittleEndian
	b := buf[:n]
	if len(b) < nlmsgHdrLen+genlHdrLen {
		return 0, fmt.Errorf("genl family %s: short answer", name)
	}
	if le.Uint16(b[4:]) == unix.NLMSG_ERROR {
		if len(b) >= nlmsgHdrLen+4 {
			if errno := int32(le.Uint32(b[nlmsgHdrLen:])); errno != 0 {
				return 0, fmt.Errorf("genl family %s: %w", name, unix.Errno(-errno))
			}
		}
		return 0, fmt.Errorf("genl family %s: an error answer", name)
	}
	for _, a := range nlAttrs(b[nlmsgHdrLen+genlHdrLen : min(int(le.Uint32(b)), len(b))]) {
		if a.typ == ctrlAttrFamilyID && len(a.data) >= 2 {
			return le.Uint16(a.data), nil
		}
	}
	return 0, fmt.Errorf("genl family %s: no ID in the answer", name)
}

// exitDelta is what the tasks that exited between two snapshots spent.
func exitDelta(a, b map[string]exitCPU) map[string]exitCPU {
	out := map[string]exitCPU{}
	for k, v := range b {
		was := a[k]
		if d := (exitCPU{tasks: v.tasks - was.tasks, cpu: v.cpu - was.cpu, runDelay: v.runDelay - was.runDelay}); d.tasks > 0 {
			out[k] = d
		}
	}
	return out
}
