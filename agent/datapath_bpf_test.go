package agent

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/cilium/ebpf/link"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/bpf"
	"github.com/kvipam/kvipam/internal/testsupport/nstest"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// bpfPinDir is a fresh pin directory on bpffs, removed at the end.
func bpfPinDir(t testing.TB) string {
	t.Helper()
	nstest.RequireRoot(t)
	if err := bpf.Supported(); err != nil {
		t.Skipf("kernel cannot run the eBPF datapath: %v", err)
	}
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	dir := filepath.Join("/sys/fs/bpf", "kvipam-agent-test-"+hex.EncodeToString(b))
	require.NoError(t, ensureBPFFS(dir))
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	return dir
}

func pinnedLinkID(t testing.TB, dir string, ifindex int) (link.ID, bool) {
	t.Helper()
	l, err := link.LoadPinnedLink(filepath.Join(dir, "links", fmt.Sprint(ifindex)), nil)
	if err != nil {
		return 0, false
	}
	defer l.Close()
	info, err := l.Info()
	require.NoError(t, err)
	return info.ID, true
}

// TestBPFEndpointLifecycle: in bpf mode, with either attach mode, endpoint
// create attaches the program before it answers; an agent that stops
// leaves it enforcing; the next agent adopts the same attachment (no
// detach); release removes it.
func TestBPFEndpointLifecycle(t *testing.T) {
	for _, mode := range []string{"tc", "tcx"} {
		t.Run(mode, func(t *testing.T) { testBPFEndpointLifecycle(t, mode) })
	}
}

func testBPFEndpointLifecycle(t *testing.T, mode string) {
	pins := bpfPinDir(t)
	host := nstest.NewNS(t)
	h := nstest.Handle(t, host)
	l := nstest.AddLink(t, h, "kvbpf0")
	e := etcdtest.Start(t)
	cfg := testConfig(t, e)
	cfg.Datapath, cfg.BPFPinDir, cfg.NetNS, cfg.BPFAttach = DatapathBPF, pins, host.Path(), mode
	ctx := context.Background()
	// attached is the link ID (tcx) or the attached program's ID (tc).
	attached := func() (uint32, bool) {
		if mode == "tcx" {
			id, ok := pinnedLinkID(t, pins, l.Attrs().Index)
			return uint32(id), ok
		}
		filters, err := h.FilterList(l, netlink.HANDLE_MIN_INGRESS)
		if err != nil {
			return 0, false
		}
		for _, f := range filters {
			if bf, ok := f.(*netlink.BpfFilter); ok {
				return uint32(bf.Id), true
			}
		}
		return 0, false
	}

	ta := startAgent(t, cfg, Options{})
	st, err := ta.c.Status(ctx)
	require.NoError(t, err)
	require.Equal(t, DatapathBPF, st.Datapath)
	o := owner(1)
	_, err = ta.c.Allocate(ctx, api.AllocateRequest{Owner: o})
	require.NoError(t, err)
	ep, err := ta.c.CreateEndpoint(ctx, api.EndpointRequest{Owner: o, HostIfName: "kvbpf0"})
	require.NoError(t, err)
	require.Equal(t, "bpf", ep.Datapath)
	id, ok := attached()
	require.True(t, ok, "the program is attached when endpoint create answers")
	_, pinned := pinnedLinkID(t, pins, l.Attrs().Index)
	require.Equal(t, mode == "tcx", pinned, "a TCX link is pinned; a tc filter needs no pin")
	eps, err := ta.c.EndpointStats(ctx)
	require.NoError(t, err)
	require.NotNil(t, eps[0].Counters)

	ta.shutdown()
	again, ok := attached()
	require.True(t, ok, "the attachment outlives the agent")
	require.Equal(t, id, again)

	ta = startAgent(t, cfg, Options{})
	again, ok = attached()
	require.True(t, ok)
	require.Equal(t, id, again, "the restarted agent adopted the attachment without detaching it")

	_, err = ta.c.Release(ctx, o)
	require.NoError(t, err)
	_, ok = attached()
	require.False(t, ok, "release detaches")
	_, ok = pinnedLinkID(t, pins, l.Attrs().Index)
	require.False(t, ok, "and unpins")
	filters, err := h.FilterList(l, netlink.HANDLE_MIN_INGRESS)
	if err == nil {
		require.Empty(t, filters, "no clsact filter left either")
	}
}
