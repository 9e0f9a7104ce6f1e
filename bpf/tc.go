//go:build linux

package bpf

import (
	"errors"
	"fmt"
	"slices"

	"github.com/cilium/ebpf"
	"github.com/containernetworking/plugins/pkg/netlinksafe"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// The clsact filter used when the kernel has no TCX. Priority 1 runs it
// before filters added with tc's default priorities; the handle ("kv")
// keeps it apart from other filters at the same priority.
const (
	tcFilterPriority = 1
	tcFilterHandle   = 0x6b76
	tcFilterName     = "kvipam_ingress"
)

// safeNL lists in the calling thread's netns, as netlink's package
// functions do, and lists again when a dump was interrupted by changes
// meanwhile (a burst of ADDs and DELs), returning the error if it still is.
var safeNL = &netlinksafe.Handle{Handle: &netlink.Handle{}}

// tcFilter is our filter running prog, on the clsact ingress (parent
// HANDLE_MIN_INGRESS) of ifindex, or on a shared block (ifindex
// TCM_IFINDEX_MAGIC_BLOCK, parent the block's index).
func tcFilter(ifindex int, parent uint32, prog *ebpf.Program) *netlink.BpfFilter {
	return &netlink.BpfFilter{
		FilterAttrs: netlink.FilterAttrs{
			LinkIndex: ifindex,
			Parent:    parent,
			Handle:    tcFilterHandle,
			Priority:  tcFilterPriority,
			Protocol:  unix.ETH_P_ALL,
		},
		Fd:           prog.FD(),
		Name:         tcFilterName,
		DirectAction: true,
	}
}

func clsact(ifindex int) *netlink.GenericQdisc {
	return &netlink.GenericQdisc{
		QdiscAttrs: netlink.QdiscAttrs{
			LinkIndex: ifindex,
			Handle:    netlink.MakeHandle(0xffff, 0),
			Parent:    netlink.HANDLE_CLSACT,
		},
		QdiscType: "clsact",
	}
}

// attachTC makes sure the clsact ingress of ifindex has our filter running
// this process's program. Replacing the filter is atomic.
func (d *Datapath) attachTC(ifindex int) error {
	err := netlink.QdiscAdd(clsact(ifindex))
	if err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("add clsact qdisc: %w", err)
	}
	if err != nil {
		// The qdisc was there: ours from an earlier attach, or another
		// tc user's. A fresh one has no filter to look for, which spares
		// a new endpoint one rtnl operation (a burst of ADDs queues on
		// rtnl).
		old, err := findTCFilter(ifindex)
		if err != nil {
			return err
		}
		if old != nil && d.sameProgram(ebpf.ProgramID(old.Id)) {
			return nil
		}
	}
	if err := netlink.FilterReplace(tcFilter(ifindex, netlink.HANDLE_MIN_INGRESS, d.objs.KvipamIngress)); err != nil {
		return fmt.Errorf("replace bpf filter: %w", err)
	}
	return nil
}

// findTCFilter returns our filter on the clsact ingress of ifindex, or nil.
func findTCFilter(ifindex int) (*netlink.BpfFilter, error) {
	dev := &netlink.Device{LinkAttrs: netlink.LinkAttrs{Index: ifindex}}
	filters, err := safeNL.FilterList(dev, netlink.HANDLE_MIN_INGRESS)
	if err != nil {
		if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOENT) {
			return nil, nil // no clsact qdisc
		}
		return nil, fmt.Errorf("list bpf filters: %w", err)
	}
	for _, f := range filters {
		if bf, ok := f.(*netlink.BpfFilter); ok && bf.Handle == tcFilterHandle && bf.Priority == tcFilterPriority {
			return bf, nil
		}
	}
	return nil, nil
}

// detachTC deletes our filter from ifindex and the clsact qdisc if that
// leaves it empty. A missing interface has nothing to detach.
func (d *Datapath) detachTC(ifindex int) error {
	if _, err := netlink.LinkByIndex(ifindex); err != nil {
		if errors.As(err, new(netlink.LinkNotFoundError)) {
			return nil
		}
		return fmt.Errorf("find link %d: %w", ifindex, err)
	}
	f, err := findTCFilter(ifindex)
	if err != nil || f == nil {
		return err
	}
	if err := netlink.FilterDel(f); err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("delete bpf filter: %w", err)
	}
	return removeEmptyClsact(ifindex)
}

// removeEmptyClsact deletes the clsact qdisc of ifindex when no filter is
// left on either of its hooks: an empty clsact does nothing, and whoever
// adds a filter next adds the qdisc as we do. Another tc user's ingress
// qdisc (the same handle; our filter may have joined it) is left alone.
func removeEmptyClsact(ifindex int) error {
	dev := &netlink.Device{LinkAttrs: netlink.LinkAttrs{Index: ifindex}}
	qdiscs, err := safeNL.QdiscList(dev)
	if err != nil {
		return fmt.Errorf("list qdiscs: %w", err)
	}
	if !slices.ContainsFunc(qdiscs, func(q netlink.Qdisc) bool { return q.Type() == "clsact" }) {
		return nil
	}
	for _, parent := range []uint32{netlink.HANDLE_MIN_INGRESS, netlink.HANDLE_MIN_EGRESS} {
		filters, err := safeNL.FilterList(dev, parent)
		if err != nil {
			return fmt.Errorf("list filters: %w", err)
		}
		if len(filters) > 0 {
			return nil
		}
	}
	if err := netlink.QdiscDel(clsact(ifindex)); err != nil && !errors.Is(err, unix.ENOENT) && !errors.Is(err, unix.EINVAL) {
		return fmt.Errorf("delete clsact qdisc: %w", err)
	}
	return nil
}
