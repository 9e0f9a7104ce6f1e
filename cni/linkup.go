package cni

import (
	"fmt"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
)

// linkUpTimeout bounds the wait for a veth end to be operationally up.
const linkUpTimeout = 5 * time.Second

// waitOperUp returns once the link name in the namespace nsh (the calling
// thread's when nsh is netns.None()) is operationally up.
//
// Setting a veth up starts its carrier, but the kernel attaches the
// queueing discipline and marks the link up a moment later, in its
// link-watch work. Until then packets are dropped (IPv4) or refused
// (IPv6: "network is unreachable"), so an ADD that returned at once
// could hand the runtime a pod whose first packets fail. The wait is on
// the kernel's link notification, listing the current state first, so
// it is usually no wait at all. (The kernel treats a veth's carrier
// change as urgent, unless the link's index happens to equal its peer's,
// as when the host namespace has no link but lo: then it waits a second.)
func waitOperUp(nsh netns.NsHandle, name string) error {
	ch := make(chan netlink.LinkUpdate, 64)
	done := make(chan struct{})
	defer func() {
		close(done)
		go func() {
			for range ch { // let the subscription's goroutine finish
			}
		}()
	}()
	err := netlink.LinkSubscribeWithOptions(ch, done, netlink.LinkSubscribeOptions{Namespace: &nsh, ListExisting: true})
	if err != nil {
		return fmt.Errorf("watch %s: %w", name, err)
	}
	timer := time.NewTimer(linkUpTimeout)
	defer timer.Stop()
	for {
		select {
		case u, ok := <-ch:
			if !ok {
				return fmt.Errorf("watch %s: subscription ended", name)
			}
			if a := u.Attrs(); a != nil && a.Name == name && a.OperState == netlink.OperUp {
				return nil
			}
		case <-timer.C:
			return fmt.Errorf("%s is not operationally up after %s", name, linkUpTimeout)
		}
	}
}
