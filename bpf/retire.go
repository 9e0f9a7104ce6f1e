//go:build linux

package bpf

import (
	"errors"
	"fmt"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
)

// Disarm removes ep's map entries and leaves the program attached to its
// host interface, which then drops every frame the pod sends (an interface
// without an ifaces entry fails closed, counted under ID 0). It is the
// first half of deleting an endpoint whose interface is about to be
// deleted: the addresses may be handed out again at once, since no entry
// names them, and the interface carries nothing while its deletion waits.
// Forget finishes it once the interface is gone. Only HostIfIndex and ID
// are used; disarming what has no entries succeeds.
func (d *Datapath) Disarm(ep Endpoint) error {
	unlock, err := d.lockEndpoint(ep.HostIfIndex)
	if err != nil {
		return err
	}
	defer unlock()
	if err := d.dropEntries(ep); err != nil {
		return err
	}
	d.log.Debug("endpoint disarmed", "id", ep.ID, "ifindex", ep.HostIfIndex)
	return nil
}

// Forget removes what a disarmed endpoint left once its interface has been
// deleted: the pin of its TCX link (a clsact filter goes with the
// interface). It refuses while the interface exists, since detaching then
// would let the pod's frames through unchecked. If the ifindex already
// names a new endpoint (ifaces entry present), its link is that
// endpoint's and is left alone.
func (d *Datapath) Forget(ifindex int) error {
	unlock, err := d.lockEndpoint(ifindex)
	if err != nil {
		return err
	}
	defer unlock()
	// One lookup needs no mapsMu: only this ifindex's lock holder changes
	// its ifaces entry.
	var info kvipamIfaceInfo
	switch err := d.objs.KvipamIfaces.Lookup(uint32(ifindex), &info); {
	case err == nil:
		return nil
	case !errors.Is(err, ebpf.ErrKeyNotExist):
		return fmt.Errorf("look up iface %d: %w", ifindex, err)
	}
	switch _, err := netlink.LinkByIndex(ifindex); {
	case err == nil:
		return fmt.Errorf("forget ifindex %d: %w", ifindex, ErrInterfaceExists)
	case !errors.As(err, new(netlink.LinkNotFoundError)):
		return fmt.Errorf("find link %d: %w", ifindex, err)
	}
	if _, err := d.detachTCX(ifindex); err != nil {
		return fmt.Errorf("forget ifindex %d: %w", ifindex, err)
	}
	return nil
}
