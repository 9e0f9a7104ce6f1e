package agent

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"testing"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/hashicorp/go-hclog"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/testsupport/nstest"
)

// cutOverAlloc is the allocator's cut-over, played: it calls at when the
// cut-over's transaction would commit, and fails with err.
type cutOverAlloc struct {
	at  func()
	err error
}

func (a cutOverAlloc) CutOver(context.Context, string, string, records.Owner) error {
	a.at()
	return a.err
}
func (cutOverAlloc) Learn(context.Context, []records.IPRef) error       { return nil }
func (cutOverAlloc) BoundRefs(records.Binding) ([]records.IPRef, error) { return nil, nil }
func (e *oneEndpoint) list() []api.Endpoint                             { return []api.Endpoint{e.ep} }
func (e *oneEndpoint) setAlternate(_ api.Owner, alt bool, apply func(api.Endpoint) error) (api.Endpoint, bool, error) {
	if e.ep.Alternate == alt {
		return e.ep, false, nil
	}
	if err := apply(e.ep); err != nil {
		return e.ep, false, err
	}
	e.ep.Alternate = alt
	return e.ep, true, nil
}

// oneEndpoint is the node's endpoints: one, a migration's second owner.
type oneEndpoint struct{ ep api.Endpoint }

// TestMigrationTargetRoutedBeforeCutOver: the target's node routes the
// addresses to the target's veth before the cut-over's transaction
// commits. Once it commits, every other node may route them to this node
// at once; a node that routed them there before this one routed them to
// its pod sent them back to the block's home, and the packets looped
// between the two nodes until their hop limit ran out
// (e2e/k8s/TestK8sLiveMigration saw ICMP time exceeded from the target's
// node, under load). A cut-over that fails takes the routes away again:
// the source forwards on.
func TestMigrationTargetRoutedBeforeCutOver(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
	}{{"committed", nil}, {"refused", fmt.Errorf("cut over: %w", records.ErrMigration)}} {
		t.Run(tc.name, func(t *testing.T) {
			host, ep := targetNode(t)
			eps := &oneEndpoint{ep: ep}
			atCommit := -1
			m := &migrations{node: "n2", eps: eps, routes: hostRoutes{netns: host.Path()}, log: hclog.NewNullLogger(),
				alloc: cutOverAlloc{at: func() { atCommit = routesTo(t, host, ep) }, err: tc.err}}
			err := m.cutOver(context.Background(), eps.ep)
			require.Equal(t, len(ep.IPs), atCommit, "both addresses routed to the target's veth when the cut-over commits")
			if tc.err != nil {
				require.True(t, errors.Is(err, records.ErrMigration), "%v", err)
				require.Zero(t, routesTo(t, host, ep), "a failed cut-over leaves no route to the target: the source forwards on")
				require.True(t, eps.ep.Alternate, "still the second owner")
				return
			}
			require.NoError(t, err)
			require.Equal(t, len(ep.IPs), routesTo(t, host, ep))
			require.False(t, eps.ep.Alternate, "the target forwards")
		})
	}
}

// targetNode is a scratch host namespace with the target pod's host veth,
// and the target's endpoint there, a migration's second owner.
func targetNode(t *testing.T) (ns.NetNS, api.Endpoint) {
	host := nstest.NewNS(t)
	var ifindex int
	require.NoError(t, host.Do(func(ns.NetNS) error {
		if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "hvtarget"}, PeerName: "pvtarget"}); err != nil {
			return err
		}
		l, err := netlink.LinkByName("hvtarget")
		if err != nil {
			return err
		}
		ifindex = l.Attrs().Index
		return netlink.LinkSetUp(l)
	}))
	return host, api.Endpoint{Owner: api.Owner{ContainerID: "dst", IfName: "eth0"}, HostIfName: "hvtarget", HostIfIndex: ifindex,
		IPs: []netip.Addr{netip.MustParseAddr("10.9.0.5"), netip.MustParseAddr("fd00:9::5")}, StickyIdentity: "vms/vm1", Pool: "p", Alternate: true}
}

// routesTo counts the host routes of ep's addresses through its veth.
func routesTo(t *testing.T, host ns.NetNS, ep api.Endpoint) (n int) {
	t.Helper()
	require.NoError(t, host.Do(func(ns.NetNS) error {
		for _, a := range ep.IPs {
			rs, err := netlink.RouteListFiltered(netlink.FAMILY_ALL, &netlink.Route{LinkIndex: ep.HostIfIndex,
				Dst: &net.IPNet{IP: a.AsSlice(), Mask: net.CIDRMask(a.BitLen(), a.BitLen())}}, netlink.RT_FILTER_OIF|netlink.RT_FILTER_DST)
			if err != nil {
				return err
			}
			n += len(rs)
		}
		return nil
	}))
	return n
}
