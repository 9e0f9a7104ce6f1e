package main

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/agent"
	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/agent/client"
	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/internal/testsupport/nstest"
)

// TestAgentCommands runs a real agent in this process (its pod interfaces
// in a scratch netns) and reads it through kvipamctl's socket commands.
func TestAgentCommands(t *testing.T) {
	host := nstest.NewNS(t)
	nstest.AddLink(t, nstest.Handle(t, host), "kvctl0")
	h := newHarness(t)
	dir, err := os.MkdirTemp("", "kvipamctl-sock-")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	cfg := agent.DefaultConfig()
	cfg.Node, cfg.StateDir, cfg.Socket, cfg.NetNS = "ctl-node", t.TempDir(), filepath.Join(dir, "a.sock"), host.Path()
	cfg.Etcd.Endpoints = h.e.Endpoints()
	cfg.MetricsAddr, cfg.Datapath, cfg.MTU, cfg.Routing = "", agent.DatapathRoutes, 1500, agent.RoutingNone
	cfg.Pools = []allocator.Pool{{Name: "default", BlockSizeV4: 28, CIDRs: []netip.Prefix{netip.MustParsePrefix("10.66.0.0/24")}}}
	a, err := agent.New(cfg, agent.Options{})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	ready, done := make(chan struct{}), make(chan error, 1)
	go func() { done <- a.Run(ctx, ready) }()
	t.Cleanup(func() { cancel(); <-done })
	<-ready

	c := client.New(cfg.Socket, 5*time.Second)
	o := api.Owner{ContainerID: "c0ffee", IfName: "eth0", Namespace: "web", Pod: "web-0"}
	_, err = c.Allocate(ctx, api.AllocateRequest{Owner: o})
	require.NoError(t, err)
	_, err = c.CreateEndpoint(ctx, api.EndpointRequest{Owner: o, HostIfName: "kvctl0"})
	require.NoError(t, err)

	var st api.Status
	require.Equal(t, exitOK, h.json(&st, "agent", "status", "--socket", cfg.Socket))
	require.True(t, st.Ready)
	require.Equal(t, "ctl-node", st.Node)
	require.Equal(t, 1, st.Pools[0].Used)

	var eps []api.Endpoint
	require.Equal(t, exitOK, h.json(&eps, "endpoint", "list", "--socket", cfg.Socket))
	require.Len(t, eps, 1)
	require.Equal(t, "kvctl0", eps[0].HostIfName)
	out := h.ok("endpoint", "stats", "--socket", cfg.Socket)
	require.Contains(t, out, "DROPPED-PKTS")
	require.Contains(t, out, "kvctl0")

	code, _, errs := h.run("endpoint", "list", "--socket", filepath.Join(dir, "nope.sock"))
	require.Equal(t, exitError, code)
	require.Contains(t, errs, "unreachable")

	// node list says which machine holds the name.
	out = h.ok("node", "list")
	require.Contains(t, out, "BOOT-ID")
	require.Contains(t, out, st.Version)

	// Another agent's record written over this one's, without the fence
	// (as an older version writes it): the agent waits to see whether its
	// lease is renewed, and its status shows the record it waits on.
	l, err := h.cli.Grant(ctx, 60)
	require.NoError(t, err)
	h.put(etcdstore.NodeKey("ctl-node"), etcdstore.NodeRecord{Name: "ctl-node", BootID: "other-boot", Addresses: []string{"192.0.2.9"},
		Version: "v-other", StartedAt: time.Now().UTC()}, clientv3.WithLease(l.ID))
	require.Eventually(t, func() bool {
		st, err := c.Status(ctx)
		return err == nil && st.NameContested != nil
	}, 10*time.Second, 20*time.Millisecond)
	out = h.ok("agent", "status", "--socket", cfg.Socket)
	for _, want := range []string{"NAME-CONTESTED-SINCE", "holder", "other-boot", "192.0.2.9", "v-other", fmt.Sprintf("%x", l.ID),
		"waiting to see whether an agent keeps it alive"} {
		require.Contains(t, out, want)
	}
	// The other agent renews its lease, once it has counted down by more
	// than etcd's whole seconds hide: the agent stops serving and its
	// status shows both agents.
	require.Eventually(t, func() bool {
		ttl, err := h.cli.TimeToLive(ctx, l.ID)
		return err == nil && ttl.TTL <= 57
	}, 30*time.Second, 100*time.Millisecond)
	_, err = h.cli.KeepAliveOnce(ctx, l.ID)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		st, err := c.Status(ctx)
		return err == nil && st.NameTaken != nil
	}, 10*time.Second, 20*time.Millisecond)
	out = h.ok("agent", "status", "--socket", cfg.Socket)
	for _, want := range []string{"NAME-TAKEN-SINCE", "holder", "other-boot", "192.0.2.9", "v-other", fmt.Sprintf("%x", l.ID), "must be unique"} {
		require.Contains(t, out, want)
	}
}
