package agent

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/testsupport/nstest"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// hostNSConfig is an agent configuration on a fresh etcd, in a scratch
// host namespace of the test's, and a netlink handle in that namespace.
func hostNSConfig(t *testing.T) (Config, *netlink.Handle) {
	nstest.RequireRoot(t)
	host := nstest.NewNS(t)
	cfg := testConfig(t, etcdtest.Start(t))
	cfg.NetNS = host.Path()
	return cfg, nstest.Handle(t, host)
}

// releaseSpy runs check when the allocator is asked to release, that is
// at the moment the addresses could be handed out again.
type releaseSpy struct {
	endpointAllocator
	check func(o records.Owner, identity string)
}

func (s releaseSpy) ReleaseAs(ctx context.Context, o records.Owner, identity string) ([]records.Allocation, error) {
	s.check(o, identity)
	return s.endpointAllocator.ReleaseAs(ctx, o, identity)
}

// TestReleaseRetiresHostVethFirst: a release that names the attachment's
// host veth (CNI DEL) finds, when the allocator frees the address, no
// route left through the veth, the veth in the reap group, and
// with bpf the program still attached (it drops everything there). The
// answer says the veth was retired; the reaper deletes it soon after, and
// with TCX its pin too.
func TestReleaseRetiresHostVethFirst(t *testing.T) {
	for _, dp := range []string{DatapathRoutes, "tc", "tcx"} {
		t.Run(dp, func(t *testing.T) { testReleaseRetiresHostVethFirst(t, dp) })
	}
}

func testReleaseRetiresHostVethFirst(t *testing.T, dp string) {
	cfg, h := hostNSConfig(t)
	if dp != DatapathRoutes {
		cfg.Datapath, cfg.BPFPinDir, cfg.BPFAttach = DatapathBPF, bpfPinDir(t), dp
	}
	ctx := context.Background()
	ta := startAgent(t, cfg, Options{})

	const name = "kvret0"
	l := nstest.AddLink(t, h, name)
	idx := l.Attrs().Index
	o := owner(1)
	res, err := ta.c.Allocate(ctx, api.AllocateRequest{Owner: o})
	require.NoError(t, err)
	addr := res.IPs[0].Address.Addr()
	dst := &net.IPNet{IP: addr.AsSlice(), Mask: net.CIDRMask(addr.BitLen(), addr.BitLen())}
	require.NoError(t, h.RouteAdd(&netlink.Route{LinkIndex: idx, Dst: dst, Scope: netlink.SCOPE_LINK}))
	// A route of another family through the veth goes too; a route
	// through another veth stays (the kernel filters the listing).
	require.NoError(t, h.RouteAdd(&netlink.Route{LinkIndex: idx, Dst: hostRoute("fd00:99::1"), Scope: netlink.SCOPE_LINK}))
	neighbour := nstest.AddLink(t, h, "kvret1")
	require.NoError(t, h.RouteAdd(&netlink.Route{LinkIndex: neighbour.Attrs().Index, Dst: hostRoute("10.99.0.1"), Scope: netlink.SCOPE_LINK}))
	_, err = ta.c.CreateEndpoint(ctx, api.EndpointRequest{Owner: o, HostIfName: name})
	require.NoError(t, err)
	attached := func() bool {
		if dp == "tcx" {
			_, ok := pinnedLinkID(t, cfg.BPFPinDir, idx)
			return ok
		}
		filters, err := h.FilterList(l, netlink.HANDLE_MIN_INGRESS)
		return err == nil && len(filters) > 0
	}

	// The check runs in the agent's handler: it records what it saw.
	var checked bool
	var problems []string
	m := ta.a.endpoints
	m.mu.Lock()
	m.alloc = releaseSpy{endpointAllocator: m.alloc, check: func(records.Owner, string) {
		checked = true
		routes, err := h.RouteListFiltered(netlink.FAMILY_ALL, &netlink.Route{LinkIndex: idx}, netlink.RT_FILTER_OIF)
		if err != nil || len(routes) > 0 {
			problems = append(problems, fmt.Sprintf("routes through the retired veth when the address is released: %v %v", routes, err))
		}
		cur, err := h.LinkByIndex(idx)
		if err != nil {
			return // already deleted by the reaper: nothing can reach the pod
		}
		if cur.Attrs().Group != reapGroup {
			problems = append(problems, fmt.Sprintf("retired veth in group %#x, not the reap group", cur.Attrs().Group))
		}
		if dp != DatapathRoutes && !attached() {
			if _, err := h.LinkByIndex(idx); err != nil {
				return // the reaper deleted it meanwhile: the filter went with it
			}
			problems = append(problems, "the program left the veth before the veth was deleted")
		}
	}}
	m.mu.Unlock()

	rel, err := ta.c.ReleaseAttachment(ctx, api.ReleaseRequest{Owner: o, HostIfName: name})
	require.NoError(t, err)
	require.True(t, checked, "the allocator was not asked to release")
	require.Empty(t, problems)
	require.Len(t, rel.Released, len(res.IPs))
	require.Contains(t, rel.Released, addr.String())
	require.Equal(t, api.HostIfRetired, rel.HostIf)
	kept, err := h.RouteListFiltered(netlink.FAMILY_V4, &netlink.Route{LinkIndex: neighbour.Attrs().Index}, netlink.RT_FILTER_OIF)
	require.NoError(t, err)
	require.Len(t, kept, 1, "the route through another veth went with the retired one's")
	require.Eventually(t, func() bool { _, err := h.LinkByName(name); return err != nil }, 30*time.Second, 5*time.Millisecond,
		"the reaper did not delete the retired veth")
	if dp == "tcx" {
		require.Eventually(t, func() bool { _, ok := pinnedLinkID(t, cfg.BPFPinDir, idx); return !ok }, 30*time.Second, 5*time.Millisecond,
			"the deleted veth's tcx link is still pinned")
	}
	eps, err := ta.c.Endpoints(ctx)
	require.NoError(t, err)
	require.Empty(t, eps)

	again, err := ta.c.ReleaseAttachment(ctx, api.ReleaseRequest{Owner: o, HostIfName: name})
	require.NoError(t, err, "a repeated DEL succeeds")
	require.Equal(t, api.HostIfAbsent, again.HostIf)
}

// TestReleaseRefusesForeignInterface: the agent retires only kvipam's own
// host veths; anything else named in a release is refused before any
// address is released.
func TestReleaseRefusesForeignInterface(t *testing.T) {
	cfg, h := hostNSConfig(t)
	ta := startAgent(t, cfg, Options{})
	ctx := context.Background()
	nstest.AddLink(t, h, "eth9")
	o := owner(1)
	_, err := ta.c.Allocate(ctx, api.AllocateRequest{Owner: o})
	require.NoError(t, err)
	held := len(ta.a.alloc.Lookup(o))
	require.NotZero(t, held)

	_, err = ta.c.ReleaseAttachment(ctx, api.ReleaseRequest{Owner: o, HostIfName: "eth9"})
	ae := apiErr(t, err)
	require.Equal(t, api.CodeBadRequest, ae.Code)
	require.Equal(t, "hostIfName", ae.Field)
	_, err = h.LinkByName("eth9")
	require.NoError(t, err, "a foreign interface was deleted")
	require.Len(t, ta.a.alloc.Lookup(o), held, "an address was released although the request was refused")
}

// TestRetiredVethDeletedAtStart: a veth retired by a DEL whose agent died
// before deleting it is deleted when the next agent starts, before it
// serves.
func TestRetiredVethDeletedAtStart(t *testing.T) {
	cfg, h := hostNSConfig(t)
	retired := nstest.AddLink(t, h, "kvdead0")
	require.NoError(t, h.LinkSetGroup(retired, reapGroup))
	live := nstest.AddLink(t, h, "kvlive0")

	startAgent(t, cfg, Options{})
	_, err := h.LinkByName("kvdead0")
	require.Error(t, err, "the retired veth outlived the restart")
	_, err = h.LinkByIndex(live.Attrs().Index)
	require.NoError(t, err, "a veth that was not retired was deleted")
}

// TestStickyDelNamesIdentity: the DEL of a sticky pod names to the
// allocator the identity its endpoint was added under, also when the
// retire of its host veth has removed the endpoint's record first; so a
// binding that names the container goes even if the allocator knows
// nothing of it (nodealloc's TestStickyDelOfLostRecordDropsBinding).
func TestStickyDelNamesIdentity(t *testing.T) {
	cfg, h := hostNSConfig(t)
	ta := startAgent(t, cfg, Options{})
	const name = "kvret1"
	o := stickyEndpoint(t, ta, h, name)
	named := namedIdentities(ta)
	_, err := ta.c.ReleaseAttachment(context.Background(), api.ReleaseRequest{Owner: o, HostIfName: name})
	require.NoError(t, err)
	require.Equal(t, []string{o.Namespace + "/" + o.Pod}, *named)
}

// stickyEndpoint ADDs pod owner(1), sticky, with its endpoint on a new
// host veth name in h (a dummy link), and returns its owner.
func stickyEndpoint(t *testing.T, ta *testAgent, h *netlink.Handle, name string) api.Owner {
	t.Helper()
	ctx := context.Background()
	nstest.AddLink(t, h, name)
	o := owner(1)
	_, err := ta.c.Allocate(ctx, api.AllocateRequest{Owner: o, Sticky: "10m"})
	require.NoError(t, err)
	_, err = ta.c.CreateEndpoint(ctx, api.EndpointRequest{Owner: o, HostIfName: name})
	require.NoError(t, err)
	return o
}

// namedIdentities makes ta's endpoint manager note the sticky identity
// each of its releases names to the allocator, in order.
func namedIdentities(ta *testAgent) *[]string {
	var named []string
	m := ta.a.endpoints
	m.mu.Lock()
	defer m.mu.Unlock()
	m.alloc = releaseSpy{endpointAllocator: m.alloc, check: func(_ records.Owner, identity string) { named = append(named, identity) }}
	return &named
}

// hostRoute is a as a host route's destination.
func hostRoute(a string) *net.IPNet {
	ip := netip.MustParseAddr(a)
	return &net.IPNet{IP: ip.AsSlice(), Mask: net.CIDRMask(ip.BitLen(), ip.BitLen())}
}
