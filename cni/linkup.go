package cni

import (
	"fmt"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
)

// linkUpTimeout bounds the wait for a veth end to be operationally up.
const linkUpTimeout = 5 * time.Second

// waitOperUp returns once the link name, seen through h in the namespace
// nsh (the calling thread's when nsh is netns.None()), is operationally
// up.
//
// Setting a veth up starts its carrier, but the kernel attaches the
// queueing discipline and marks the link up a moment later, in its
// link-watch work. Until then packets are dropped (IPv4) or refused
// (IPv6: "network is unreachable"), so an ADD that returned at once could
// hand the runtime a pod whose first packets fail. Usually the link is up
// by the first look. Otherwise the wait is on the kernel's link
// notifications, looking again once subscribed so no change is missed;
// a subscription that breaks (its socket overflows on a node with many
// link changes) is made again.
func waitOperUp(h *netlink.Handle, nsh netns.NsHandle, name string) error {
	deadline := time.Now().Add(linkUpTimeout)
	for {
		if up, err := operUp(h, name); err != nil || up {
			return err
		}
		if up, err := waitEvent(h, nsh, name, deadline); err != nil || up {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s is not operationally up after %s", name, linkUpTimeout)
		}
	}
}

func operUp(h *netlink.Handle, name string) (bool, error) {
	l, err := h.LinkByName(name)
	if err != nil {
		return false, fmt.Errorf("look at %s: %w", name, err)
	}
	return l.Attrs().OperState == netlink.OperUp, nil
}

// waitEvent subscribes to link changes and waits for name to be up. It
// returns false, with no error, when the subscription broke or the
// deadline passed.
func waitEvent(h *netlink.Handle, nsh netns.NsHandle, name string, deadline time.Time) (bool, error) {
	ch := make(chan netlink.LinkUpdate, 64)
	done := make(chan struct{})
	defer func() {
		close(done)
		go func() {
			for range ch { // let the subscription's goroutine finish
			}
		}()
	}()
	opts := netlink.LinkSubscribeOptions{Namespace: &nsh, ReceiveBufferSize: 1 << 20}
	if err := netlink.LinkSubscribeWithOptions(ch, done, opts); err != nil {
		return false, fmt.Errorf("watch %s: %w", name, err)
	}
	if up, err := operUp(h, name); err != nil || up {
		return up, err
	}
	timer := time.NewTimer(time.Until(deadline))
	defer timer.Stop()
	for {
		select {
		case u, ok := <-ch:
			if !ok {
				return false, nil
			}
			if a := u.Attrs(); a != nil && a.Name == name && a.OperState == netlink.OperUp {
				return true, nil
			}
		case <-timer.C:
			return false, nil
		}
	}
}
