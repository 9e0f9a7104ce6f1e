//go:build linux

package bpf

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
)

// hostLinksDir holds the TCX links of the host port programs: in-<ifindex>
// on each uplink's ingress, lo on lo's egress. Apart from links/, whose
// entries are endpoints.
const hostLinksDir = "hostlinks"

// AttachHostPorts makes the node serve host ports (hostport.h) to other
// hosts arriving on the uplinks (interface indexes) and to its own
// processes (lo). Links are pinned like the endpoints'; one already pinned
// is kept and made to run this process's program, without a gap, and an
// uplink pinned before but not named now is detached. Like Attach, it
// resolves interfaces in the calling thread's network namespace. It needs
// TCX.
func (d *Datapath) AttachHostPorts(uplinks []int) error {
	if err := d.lock(); err != nil {
		return err
	}
	defer d.mu.Unlock()
	dir := filepath.Join(d.pinDir, hostLinksDir)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("create host links dir: %w", err)
	}
	lo, err := netlink.LinkByName("lo")
	if err != nil {
		return fmt.Errorf("find lo: %w", err)
	}
	want := map[string]bool{"lo": true}
	var errs []error
	if err := d.attachHost(filepath.Join(dir, "lo"), lo.Attrs().Index, ebpf.AttachTCXEgress, d.objs.KvipamHostportLocal); err != nil {
		errs = append(errs, fmt.Errorf("lo: %w", err))
	}
	for _, ifindex := range uplinks {
		name := "in-" + strconv.Itoa(ifindex)
		want[name] = true
		if err := d.attachHost(filepath.Join(dir, name), ifindex, ebpf.AttachTCXIngress, d.objs.KvipamHostportIn); err != nil {
			errs = append(errs, fmt.Errorf("uplink %d: %w", ifindex, err))
		}
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return errors.Join(append(errs, fmt.Errorf("read host links dir: %w", err))...)
	}
	for _, e := range entries {
		if want[e.Name()] || !strings.HasPrefix(e.Name(), "in-") {
			continue
		}
		d.log.Info("detaching host port program from an uplink no longer named", "pin", e.Name())
		if err := detachPinned(filepath.Join(dir, e.Name())); err != nil {
			errs = append(errs, err)
		}
	}
	d.log.Debug("host port programs attached", "uplinks", uplinks, "lo", lo.Attrs().Index)
	return errors.Join(errs...)
}

// attachHost makes sure a live TCX link pinned at pin runs prog on ifindex
// in the direction at.
func (d *Datapath) attachHost(pin string, ifindex int, at ebpf.AttachType, prog *ebpf.Program) error {
	l, err := link.LoadPinnedLink(pin, nil)
	switch {
	case err == nil:
		defer l.Close()
		info, err := l.Info()
		if err != nil {
			return fmt.Errorf("tcx link info: %w", err)
		}
		if tcx := info.TCX(); tcx != nil && tcx.Ifindex == uint32(ifindex) && ebpf.AttachType(tcx.AttachType) == at {
			if err := l.Update(prog); err != nil {
				return fmt.Errorf("update tcx link program: %w", err)
			}
			return nil
		}
		// The interface is gone or the ifindex is another's now.
		if err := errors.Join(l.Unpin(), l.Detach()); err != nil && !errors.Is(err, os.ErrNotExist) {
			d.log.Warn("removing a defunct host port link", "pin", pin, "error", err)
		}
	case !errors.Is(err, os.ErrNotExist):
		return fmt.Errorf("load pinned tcx link: %w", err)
	}
	nl, err := link.AttachTCX(link.TCXOptions{Interface: ifindex, Program: prog, Attach: at, Anchor: link.Tail()})
	if err != nil {
		return fmt.Errorf("attach tcx link: %w", err)
	}
	defer nl.Close()
	if err := nl.Pin(pin); err != nil {
		return fmt.Errorf("pin tcx link: %w", err)
	}
	return nil
}

func detachPinned(pin string) error {
	l, err := link.LoadPinnedLink(pin, nil)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("load pinned link %s: %w", pin, err)
	}
	defer l.Close()
	if err := l.Detach(); err != nil {
		return fmt.Errorf("detach %s: %w", pin, err)
	}
	return l.Unpin()
}

// DetachHostPorts removes every host port program (the agent's uninstall).
func (d *Datapath) DetachHostPorts() error {
	if err := d.lock(); err != nil {
		return err
	}
	defer d.mu.Unlock()
	dir := filepath.Join(d.pinDir, hostLinksDir)
	entries, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("read host links dir: %w", err)
	}
	var errs []error
	for _, e := range entries {
		errs = append(errs, detachPinned(filepath.Join(dir, e.Name())))
	}
	return errors.Join(errs...)
}
