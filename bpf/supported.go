//go:build linux

package bpf

import (
	"errors"
	"fmt"
	"runtime"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/cilium/ebpf/rlimit"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// Supported reports whether this kernel can load the program and attach it
// to an interface, by doing both: it loads the program with unpinned maps and
// attaches it to the loopback device of a throwaway network namespace, with
// TCX or else a clsact filter. It returns nil on success and otherwise an
// error saying what failed; the agent then runs without the eBPF datapath.
// It needs the privileges the agent has (CAP_SYS_ADMIN, CAP_NET_ADMIN, CAP_BPF).
func Supported() error {
	if err := rlimit.RemoveMemlock(); err != nil {
		return fmt.Errorf("remove memlock rlimit: %w", err)
	}
	spec, err := loadKvipam()
	if err != nil {
		return fmt.Errorf("load ebpf spec: %w", err)
	}
	for _, m := range spec.Maps {
		m.Pinning = ebpf.PinNone
	}
	var objs kvipamObjects
	if err := spec.LoadAndAssign(&objs, nil); err != nil {
		return fmt.Errorf("load ebpf objects: %w", err)
	}
	defer objs.Close()
	return inThrowawayNetns(func() error { return tryAttach(objs.KvipamIngress) })
}

func tryAttach(prog *ebpf.Program) error {
	lo, err := netlink.LinkByName("lo")
	if err != nil {
		return fmt.Errorf("find lo: %w", err)
	}
	ifindex := lo.Attrs().Index
	l, err := link.AttachTCX(link.TCXOptions{Interface: ifindex, Program: prog, Attach: ebpf.AttachTCXIngress})
	if err == nil {
		return l.Close()
	}
	if !errors.Is(err, ebpf.ErrNotSupported) {
		return fmt.Errorf("attach tcx link: %w", err)
	}
	if err := netlink.QdiscAdd(clsact(ifindex)); err != nil {
		return fmt.Errorf("no tcx, and add clsact qdisc: %w", err)
	}
	if err := netlink.FilterAdd(tcFilter(ifindex, netlink.HANDLE_MIN_INGRESS, prog)); err != nil {
		return fmt.Errorf("no tcx, and add bpf filter: %w", err)
	}
	return nil
}

// inThrowawayNetns runs fn on a locked OS thread moved into a new, empty
// network namespace. The thread is never unlocked, so the runtime ends it
// with the goroutine and nothing else ever runs in that namespace, which
// vanishes with it.
func inThrowawayNetns(fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			errc <- fmt.Errorf("create network namespace: %w", err)
			return
		}
		errc <- fn()
	}()
	return <-errc
}
