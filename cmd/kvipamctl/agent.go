package main

import (
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/agent/client"
)

// agentClient talks to the local agent's socket (--socket, default the
// agent's default path).
func (a *app) agentClient() *client.Client {
	return client.New(a.flags.socket, a.flags.timeout)
}

func (a *app) agentCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "agent", Short: "Ask the local agent (over --socket)"}
	cmd.AddCommand(&cobra.Command{
		Use:   "status",
		Short: "The agent's status: etcd, lease, per-pool capacity of this node",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			st, err := a.agentClient().Status(cmd.Context())
			if err != nil {
				return err
			}
			return a.render(a.stdout, st, func(w io.Writer) {
				row(w, "NODE", "READY", "ETCD", "LEASE", "DATAPATH", "MESSAGE")
				row(w, st.Node, st.Ready, st.Etcd.Reachable, st.Lease.State, st.Datapath, st.Message)
				if nt := st.NameTaken; nt != nil {
					// Another agent holds the node's name: both agents.
					row(w)
					row(w, "NAME-TAKEN-SINCE", "AGENT", "BOOT-ID", "ADDRESSES", "VERSION", "STARTED", "LEASE")
					row(w, nt.Since, "holder", nt.Holder.BootID, strings.Join(nt.Holder.Addresses, ","), nt.Holder.Version, nt.Holder.StartedAt, leaseText(nt.Holder.Lease))
					row(w, "", "this", nt.Self.BootID, strings.Join(nt.Self.Addresses, ","), nt.Self.Version, nt.Self.StartedAt, leaseText(nt.Self.Lease))
				}
				if nc := st.NameContested; nc != nil {
					// Another incarnation's record, on a lease not yet
					// seen renewed: the agent waits to see.
					row(w)
					row(w, "NAME-CONTESTED-SINCE", "RECORD", "BOOT-ID", "ADDRESSES", "VERSION", "STARTED", "LEASE")
					row(w, nc.Since, "holder", nc.Holder.BootID, strings.Join(nc.Holder.Addresses, ","), nc.Holder.Version, nc.Holder.StartedAt, leaseText(nc.Holder.Lease))
				}
				row(w)
				row(w, "POOL", "FAMILY", "BLOCKS", "CAPACITY", "USED", "RESERVED", "FREE", "EXHAUSTED")
				for _, p := range st.Pools {
					row(w, p.Pool, p.Family, len(p.Blocks), p.Capacity, p.Used, p.Reserved, p.Free, p.Exhausted)
				}
				refusedPools(w, st.Pools)
				if b := st.BGP; b != nil {
					row(w)
					row(w, "BGP-ASN", "ANNOUNCED-V4", "ANNOUNCED-V6", "ERROR")
					row(w, b.ASN, b.Announced["ipv4"], b.Announced["ipv6"], b.Error)
					row(w)
					row(w, "PEER", "PEER-ASN", "STATE", "UPTIME", "ADVERTISED-V4", "ADVERTISED-V6", "RECEIVED-V4", "RECEIVED-V6", "DOWN-SINCE", "REASON")
					for _, p := range b.Peers {
						row(w, p.Address, p.ASN, p.State, p.Uptime, p.Advertised["ipv4"], p.Advertised["ipv6"], p.Received["ipv4"], p.Received["ipv6"], p.ReasonSince, p.Reason)
					}
				}
			})
		},
	})
	return cmd
}

// refusedPools lists the pools the agent refuses, once each, with why.
func refusedPools(w io.Writer, pools []api.PoolStatus) {
	seen := map[string]bool{}
	for _, p := range pools {
		if p.Refused == "" || seen[p.Pool] {
			continue
		}
		if len(seen) == 0 {
			row(w)
			row(w, "REFUSED-POOL", "REASON")
		}
		seen[p.Pool] = true
		row(w, p.Pool, p.Refused)
	}
}

// leaseText is an etcd lease ID as etcdctl takes it (hex), "" for none.
func leaseText(id int64) string {
	if id == 0 {
		return ""
	}
	return fmt.Sprintf("%x", id)
}

func (a *app) endpointCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "endpoint", Short: "Pod endpoints the local agent programmed (over --socket)"}
	cmd.AddCommand(&cobra.Command{
		Use:   "list",
		Short: "Every endpoint: owner, host interface, addresses, datapath",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			eps, err := a.agentClient().Endpoints(cmd.Context())
			if err != nil {
				return err
			}
			return a.render(a.stdout, eps, func(w io.Writer) {
				row(w, "ID", "CONTAINER", "IFNAME", "POD", "HOST-IF", "IFINDEX", "IPS", "DATAPATH", "CREATED")
				for _, ep := range eps {
					row(w, ep.ID, short(ep.Owner.ContainerID), ep.Owner.IfName, podName(ep.Owner), ep.HostIfName, ep.HostIfIndex, ep.IPs, ep.Datapath, ep.Created.Format(time.RFC3339))
				}
			})
		},
	})
	cmd.AddCommand(&cobra.Command{
		Use:   "stats",
		Short: "Per-endpoint packets and bytes passed and dropped (spoofed source) by the eBPF datapath",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			eps, err := a.agentClient().EndpointStats(cmd.Context())
			if err != nil {
				return err
			}
			return a.render(a.stdout, eps, func(w io.Writer) {
				row(w, "ID", "CONTAINER", "HOST-IF", "PASSED-PKTS", "PASSED-BYTES", "DROPPED-PKTS", "DROPPED-BYTES")
				for _, ep := range eps {
					c := ep.Counters
					if c == nil {
						c = &api.Counters{}
					}
					row(w, ep.ID, short(ep.Owner.ContainerID), ep.HostIfName, c.PassedPackets, c.PassedBytes, c.DroppedPackets, c.DroppedBytes)
				}
			})
		},
	})
	return cmd
}

func short(id string) string {
	if len(id) > 12 {
		return id[:12]
	}
	return id
}

func podName(o api.Owner) string {
	if o.Pod == "" {
		return ""
	}
	return o.Namespace + "/" + o.Pod
}
