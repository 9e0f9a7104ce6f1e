package announce

import (
	"fmt"
	"net"

	"github.com/containernetworking/plugins/pkg/ns"
)

// inNetns runs fn on a locked OS thread in the network namespace at path,
// or in the caller's when path is "". A socket keeps the namespace it was
// created in, so the watcher's sockets are created here and read anywhere.
func inNetns(path string, fn func() error) error {
	if path == "" {
		return fn()
	}
	return ns.WithNetNSPath(path, func(ns.NetNS) error { return fn() })
}

// checkIfindex fails unless ifindex is hostIf in the calling thread's
// namespace: a stale index would watch another pod's veth.
func checkIfindex(hostIf string, ifindex int) error {
	ifc, err := net.InterfaceByIndex(ifindex)
	if err != nil {
		return fmt.Errorf("%w: no interface of index %d: %w", ErrInvalidWatch, ifindex, err)
	}
	if ifc.Name != hostIf {
		return fmt.Errorf("%w: interface %d is %s, not %s", ErrInvalidWatch, ifindex, ifc.Name, hostIf)
	}
	return nil
}
