package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"time"

	"github.com/kvipam/kvipam/agent"
	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/agent/client"
	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/kvstore"
)

// runAgent starts kvipam-agent's daemon in this process on an embedded
// etcd it asks for by name, allocates through its socket as the CNI plugin would, and shows
// what landed in etcd.
func runAgent(ctx context.Context, w io.Writer) error {
	dir, err := os.MkdirTemp("", "kvipam-demo-agent-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	cfg := agent.DefaultConfig()
	cfg.Node = "demo-node"
	// An agent runs an etcd of its own only when asked for it by name: a
	// configuration that names no etcd is refused (invariant 9).
	cfg.Etcd.Embedded = true
	cfg.StateDir = dir
	cfg.Socket = filepath.Join(dir, "agent.sock")
	cfg.MetricsAddr = ""
	cfg.Datapath = agent.DatapathRoutes
	cfg.MTU = 1500
	cfg.Routing = agent.RoutingNone // a demo changes nothing on this host
	cfg.Pools = []allocator.Pool{{Name: "default", BlockSizeV4: 26, BlockSizeV6: 120,
		CIDRs: []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16"), netip.MustParsePrefix("fd00:244::/64")}}}
	a, err := agent.New(cfg, agent.Options{Version: "demo"})
	if err != nil {
		return err
	}
	step(w, "start kvipam-agent --node demo-node --etcd-embedded --pool default=10.244.0.0/16,fd00:244::/64")
	fmt.Fprintf(w, "  the embedded etcd in %s runs because --etcd-embedded asks for it by name;\n"+
		"  an agent whose configuration names no etcd (or misspells etcd.endpoints) refuses to start\n", filepath.Join(dir, "etcd"))
	actx, stop := context.WithCancel(ctx)
	ready := make(chan struct{})
	done := make(chan error, 1)
	go func() { done <- a.Run(actx, ready) }()
	select {
	case <-ready:
	case err := <-done:
		stop()
		return err
	}
	defer func() { stop(); <-done }()

	c := client.New(cfg.Socket, 5*time.Second)
	owner := api.Owner{ContainerID: "4f1c9a", IfName: "eth0", Namespace: "web", Pod: "web-0"}
	step(w, "POST %s on %s (what the CNI plugin sends on ADD)", api.PathAllocate, cfg.Socket)
	res, err := c.Allocate(ctx, api.AllocateRequest{Owner: owner})
	if err != nil {
		return err
	}
	if err := printJSON(w, res); err != nil {
		return err
	}
	step(w, "the reservation, read back with etcdctl get --prefix /kvipam/v1/:")
	st, err := c.Status(ctx)
	if err != nil {
		return err
	}
	cli, err := kvstore.Connect(ctx, kvstore.Config{Endpoints: st.Etcd.Endpoints}, etcdstore.HealthKey())
	if err != nil {
		return err
	}
	defer cli.Close()
	if err := dumpKeys(ctx, w, cli, etcdstore.Prefix, 20); err != nil {
		return err
	}
	step(w, "GET %s", api.PathStatus)
	if err := printJSON(w, st); err != nil {
		return err
	}
	step(w, "POST %s (CNI DEL): the addresses go back", api.PathRelease)
	rel, err := c.Release(ctx, owner)
	if err != nil {
		return err
	}
	fmt.Fprintf(w, "  released %v\n", rel.Released)
	return nil
}

func printJSON(w io.Writer, v any) error {
	b, err := json.MarshalIndent(v, "  ", "  ")
	if err != nil {
		return err
	}
	_, err = fmt.Fprintf(w, "  %s\n", b)
	return err
}
