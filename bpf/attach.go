//go:build linux

package bpf

import (
	"errors"
	"fmt"

	"github.com/cilium/ebpf"
)

// Attach installs ep: it writes its map entries, then attaches the program to
// the ingress of the host veth ep.HostIfIndex with a TCX link, pinned under
// links/<ifindex> so that it outlives the agent. On a kernel without TCX it
// uses a clsact qdisc and a BPF filter instead.
//
// Attach is idempotent: for an interface that is already attached it keeps
// the link (no second attachment, no gap) and updates the map entries;
// addresses dropped from ep are removed only after the new ones are in place.
// On failure the maps are put back as they were.
func (d *Datapath) Attach(ep Endpoint) error {
	ep, err := ep.normalize()
	if err != nil {
		return err
	}
	unlock, err := d.lockEndpoint(ep.HostIfIndex)
	if err != nil {
		return err
	}
	defer unlock()

	ifindex := uint32(ep.HostIfIndex)
	var (
		prevID  uint32
		hadPrev bool
		undo    undoList
	)
	if err := d.withMaps(func() error {
		prevID, hadPrev = d.owners.ids[ifindex]
		var err error
		undo, err = d.writeEndpoint(ep)
		if err != nil {
			return errors.Join(fmt.Errorf("write endpoint %d: %w", ep.ID, err), undo.run())
		}
		return nil
	}); err != nil {
		return err
	}
	if err := d.attachProgram(ep.HostIfIndex, ep.Attach); err != nil {
		return errors.Join(fmt.Errorf("attach endpoint %d: %w", ep.ID, err), d.withMaps(undo.run))
	}

	if err := d.withMaps(func() error {
		var errs []error
		if err := d.removeAddrs(ifindex, ep.IPs); err != nil {
			errs = append(errs, err)
		}
		if err := d.removePorts(ifindex, ep.Ports); err != nil {
			errs = append(errs, err)
		}
		if hadPrev && prevID != ep.ID {
			if err := d.dropUnusedCounters(prevID); err != nil {
				errs = append(errs, err)
			}
		}
		return errors.Join(errs...)
	}); err != nil {
		return fmt.Errorf("clean up previous entries of ifindex %d: %w", ifindex, err)
	}
	d.log.Debug("endpoint attached", "id", ep.ID, "ifindex", ep.HostIfIndex, "ifname", ep.HostIfName, "ips", ep.IPs)
	return nil
}

// How the program is attached to a host veth (SetAttachMode).
const (
	// AttachTCX: a TCX link at the head of the interface's chain, pinned.
	// It orders the program before any other TCX program, but each attach
	// and detach waits for an RCU grace period (about 25 ms here, more on
	// a busy host).
	AttachTCX = "tcx"
	// AttachTC: a clsact qdisc and a BPF filter (priority 1). It runs
	// after any TCX program on the interface, a clsact qdisc excludes the
	// ingress qdisc (the bandwidth plugin's egress shaping adds one), and
	// it costs about 1 ms to attach and detach: the kernel frees the old
	// state after a grace period instead of waiting for one.
	AttachTC = "tc"
)

// SetAttachMode chooses how Attach attaches the program to endpoints that
// do not say (Endpoint.Attach), from now on: AttachTCX by default.
// Endpoints already attached stay as they are.
func (d *Datapath) SetAttachMode(mode string) error {
	if err := d.lock(); err != nil {
		return err
	}
	defer d.mu.Unlock()
	if err := checkMode(mode); err != nil {
		return err
	}
	d.mode = mode
	return nil
}

func checkMode(mode string) error {
	if mode != AttachTCX && mode != AttachTC {
		return fmt.Errorf("bpf: attach mode %q is not %s or %s", mode, AttachTCX, AttachTC)
	}
	return nil
}

// attachHook, when set (by tests only), is called at the start of each
// kernel attach, with the lock of the interface held.
var attachHook func(ifindex int)

// attachProgram attaches as mode says ("" is the datapath's mode): with
// TCX, or with a clsact filter when chosen or once the kernel has said it
// has no TCX.
func (d *Datapath) attachProgram(ifindex int, mode string) error {
	if attachHook != nil {
		attachHook(ifindex)
	}
	if mode == "" {
		mode = d.mode
	}
	if mode == AttachTCX && !d.noTCX.Load() {
		err := d.attachTCX(ifindex)
		if !errors.Is(err, ebpf.ErrNotSupported) {
			return err
		}
		if d.noTCX.CompareAndSwap(false, true) {
			d.log.Warn("kernel has no tcx, attaching with clsact filters", "error", err)
		}
	}
	return d.attachTC(ifindex)
}

// Detach removes everything Attach installed for ep.HostIfIndex: the link
// (unpinned and detached) or clsact filter, and the map entries. Only
// HostIfIndex and ID are used. Detach is idempotent and works when the
// interface no longer exists. If the program cannot be detached the map
// entries are kept, so that a retry finds the endpoint.
func (d *Datapath) Detach(ep Endpoint) error {
	unlock, err := d.lockEndpoint(ep.HostIfIndex)
	if err != nil {
		return err
	}
	defer unlock()

	if err := d.detachProgram(ep.HostIfIndex); err != nil {
		return fmt.Errorf("detach endpoint on ifindex %d: %w", ep.HostIfIndex, err)
	}
	if err := d.dropEntries(ep); err != nil {
		return err
	}
	d.log.Debug("endpoint detached", "id", ep.ID, "ifindex", ep.HostIfIndex)
	return nil
}

// dropEntries removes ep's map entries. The caller holds ep's lock.
func (d *Datapath) dropEntries(ep Endpoint) error {
	if err := d.withMaps(func() error { return d.removeEndpoint(uint32(ep.HostIfIndex), ep.ID) }); err != nil {
		return fmt.Errorf("remove the map entries of the endpoint on ifindex %d: %w", ep.HostIfIndex, err)
	}
	return nil
}

func (d *Datapath) detachProgram(ifindex int) error {
	found, err := d.detachTCX(ifindex)
	if err != nil || found {
		return err
	}
	return d.detachTC(ifindex)
}
