package cni

import (
	"os"
	"testing"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"

	"github.com/kvipam/kvipam/internal/testsupport/nstest"
)

// newNS makes a network namespace for one test, with lo up, removed when
// the test ends. It skips the test when not root.
func newNS(t testing.TB) ns.NetNS { return nstest.NewNS(t) }

// newHostNS is a namespace standing for a node: it has an uplink, as a
// node has a NIC, so its veths' indexes differ from the pods' (see
// waitOperUp).
func newHostNS(t testing.TB) ns.NetNS {
	t.Helper()
	n := newNS(t)
	la := netlink.NewLinkAttrs()
	la.Name = "uplink0"
	require.NoError(t, handle(t, n).LinkAdd(&netlink.Veth{LinkAttrs: la, PeerName: "uplink1"}))
	return n
}

// handle is a netlink handle bound to n, closed at cleanup.
func handle(t testing.TB, n ns.NetNS) *netlink.Handle { return nstest.Handle(t, n) }

// in runs f with the calling thread in n, as a plugin runs in the node's
// namespace.
func in(t testing.TB, n ns.NetNS, f func() error) error {
	t.Helper()
	return n.Do(func(ns.NetNS) error { return f() })
}

// readSysctl reads /proc/sys/net/<key> as seen from n.
func readSysctl(t testing.TB, n ns.NetNS, key string) string {
	t.Helper()
	var v []byte
	require.NoError(t, in(t, n, func() (err error) {
		v, err = os.ReadFile(procSysNet + "/" + key)
		return err
	}))
	return string(v)
}
