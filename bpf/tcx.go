//go:build linux

package bpf

import (
	"errors"
	"fmt"
	"os"
	"slices"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
)

// attachTCX makes sure a live TCX link pinned at links/<ifindex> runs the
// program on the ingress of ifindex.
func (d *Datapath) attachTCX(ifindex int) error {
	pin := d.linkPin(ifindex)
	l, err := link.LoadPinnedLink(pin, nil)
	switch {
	case err == nil:
		live, err := d.refreshLink(l, ifindex)
		if err != nil || live {
			return errors.Join(err, l.Close())
		}
		// The interface this link was made for is gone and its ifindex
		// has been reused: the link is defunct, make a new one.
		d.log.Info("replacing defunct tcx link", "ifindex", ifindex)
		if err := errors.Join(l.Unpin(), l.Close()); err != nil {
			return fmt.Errorf("remove defunct tcx link: %w", err)
		}
	case !errors.Is(err, os.ErrNotExist):
		return fmt.Errorf("load pinned tcx link: %w", err)
	}

	l, err = link.AttachTCX(link.TCXOptions{
		Interface: ifindex,
		Program:   d.objs.KvipamIngress,
		Attach:    ebpf.AttachTCXIngress,
		// First, so that no program before it can accept a spoofed frame.
		Anchor: link.Head(),
	})
	if err != nil {
		return fmt.Errorf("attach tcx link: %w", err)
	}
	// From here the pin keeps the link attached, not this descriptor; if
	// pinning fails, closing it detaches the program again.
	defer l.Close()
	if err := l.Pin(pin); err != nil {
		return fmt.Errorf("pin tcx link: %w", err)
	}
	return nil
}

// refreshLink reports whether l is attached to the ingress of ifindex and, if
// so, makes it run this process's program, atomically, without detaching.
func (d *Datapath) refreshLink(l link.Link, ifindex int) (bool, error) {
	info, err := l.Info()
	if err != nil {
		return false, fmt.Errorf("tcx link info: %w", err)
	}
	tcx := info.TCX()
	if tcx == nil || tcx.Ifindex != uint32(ifindex) || ebpf.AttachType(tcx.AttachType) != ebpf.AttachTCXIngress {
		return false, nil
	}
	if d.sameProgram(info.Program) {
		return true, nil
	}
	if err := l.Update(d.objs.KvipamIngress); err != nil {
		return true, fmt.Errorf("update tcx link program: %w", err)
	}
	d.log.Info("tcx link now runs this agent's program", "ifindex", ifindex, "old_prog_id", info.Program)
	return true, nil
}

// sameProgram reports whether the program id has the same code as ours and
// uses the same maps, so that an adopted attachment need not be updated.
func (d *Datapath) sameProgram(id ebpf.ProgramID) bool {
	if id == d.progID {
		return true
	}
	prog, err := ebpf.NewProgramFromID(id)
	if err != nil {
		return false
	}
	defer prog.Close()
	info, err := prog.Info()
	if err != nil || info.Tag != d.progTag {
		return false
	}
	maps, ok := info.MapIDs()
	if !ok {
		return false
	}
	slices.Sort(maps)
	return slices.Equal(maps, d.mapIDs)
}

// detachTCX detaches and unpins the link of ifindex and reports whether
// there was one. A link whose interface is gone detaches without error.
func (d *Datapath) detachTCX(ifindex int) (bool, error) {
	l, err := link.LoadPinnedLink(d.linkPin(ifindex), nil)
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("load pinned tcx link: %w", err)
	}
	defer l.Close()
	// Detach first: if it fails, the pin stays and a retry finds the link.
	if err := l.Detach(); err != nil {
		return true, fmt.Errorf("detach tcx link: %w", err)
	}
	if err := l.Unpin(); err != nil {
		return true, fmt.Errorf("unpin tcx link: %w", err)
	}
	return true, nil
}
