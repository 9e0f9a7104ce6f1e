package main

import (
	"context"
	"fmt"
	"io"
	"net/netip"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/records"
)

// historyOpts are the flags of ip history.
type historyOpts struct {
	pool, pod    string
	since, until string
}

// historyRow is one ownership interval; an open one (the live owner) has
// no end.
type historyRow struct {
	etcdstore.HistoryRecord
	Current bool `json:"current,omitempty"`
	// Alternate marks a live migration's second, non-forwarding owner
	// (current: its interval is open).
	Alternate bool `json:"alternate,omitempty"`
}

func (a *app) ipHistoryCmd() *cobra.Command {
	var o historyOpts
	cmd := &cobra.Command{
		Use:   "history [IP]",
		Short: "Who held an address, and when",
		Long: `List the ownership intervals of an address, oldest first: every ended one
(kept for the agents' --history-retention, whatever etcd's compaction does)
and the live owner's, which has no end yet. Without IP, --pod (namespace/name)
lists the intervals of a pod's addresses. --since and --until keep intervals
that overlap that time range (RFC 3339, or how long ago such as 2h).`,
		Args: cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			var ip string
			if len(args) == 1 {
				ip = args[0]
			}
			return a.ipHistory(cmd.Context(), a.stdout, ip, o)
		},
	}
	cmd.Flags().StringVar(&o.pool, "pool", "", "the pool of the address (default: whichever holds it)")
	cmd.Flags().StringVar(&o.pod, "pod", "", "namespace/name of a pod")
	cmd.Flags().StringVar(&o.since, "since", "", "only intervals that ended at or after this time")
	cmd.Flags().StringVar(&o.until, "until", "", "only intervals that started at or before this time")
	return cmd
}

func (a *app) ipHistory(ctx context.Context, w io.Writer, ip string, o historyOpts) error {
	var f etcdstore.HistoryFilter
	now := time.Now()
	var err error
	if ip != "" {
		if f.IP, err = netip.ParseAddr(ip); err != nil {
			return fmt.Errorf("%q is not an IP address", ip)
		}
	}
	if o.pod != "" {
		ns, name, ok := strings.Cut(o.pod, "/")
		if !ok || ns == "" || name == "" {
			return fmt.Errorf("--pod %q: want namespace/name", o.pod)
		}
		f.Namespace, f.Pod = ns, name
	}
	if ip == "" && o.pod == "" {
		return fmt.Errorf("name an address, or a pod with --pod namespace/name")
	}
	if o.since != "" {
		if f.Since, err = parseWhen("--since", o.since, now); err != nil {
			return err
		}
	}
	if o.until != "" {
		if f.Until, err = parseWhen("--until", o.until, now); err != nil {
			return err
		}
	}
	_, s, err := a.snapshot(ctx)
	if err != nil {
		return err
	}
	f.Pool = o.pool
	if f.Pool == "" && f.IP.IsValid() {
		for name, p := range s.Pools {
			if p.Pool.Contains(f.IP) {
				f.Pool = name
			}
		}
	}
	var recs []etcdstore.HistoryRecord
	if err := a.withStore(ctx, func(s operatorStore) (err error) { recs, err = s.History(ctx, f); return err }); err != nil {
		return err
	}
	rows := make([]historyRow, 0, len(recs)+1)
	for _, r := range recs {
		rows = append(rows, historyRow{HistoryRecord: r})
	}
	for _, cur := range s.IPs { // the live owners: intervals still open
		r := etcdstore.HistoryOf(records.Allocation{Record: cur.Record, Pool: cur.Pool, Block: cur.Block, Addr: cur.Addr}, time.Time{}, "")
		if (f.IP.IsValid() && cur.Addr != f.IP) || (f.Pool != "" && cur.Pool != f.Pool) ||
			(f.Pod != "" && (cur.Pod != f.Pod || cur.Namespace != f.Namespace)) || (!f.Until.IsZero() && cur.Since.After(f.Until)) {
			continue
		}
		rows = append(rows, historyRow{HistoryRecord: r, Current: true})
		if alt := cur.Alternate; alt != nil {
			r.Owner, r.Node, r.Start = alt.Owner, alt.Node, alt.Since.UTC()
			rows = append(rows, historyRow{HistoryRecord: r, Current: true, Alternate: true})
		}
	}
	return a.render(w, rows, func(tw io.Writer) {
		row(tw, "POOL", "IP", "START", "END", "POD", "CONTAINER", "IFNAME", "NODE", "ENDED BY")
		for _, r := range rows {
			end, by := r.End.Format(time.RFC3339Nano), r.Reason
			switch {
			case r.Alternate:
				end, by = "-", "(current, second owner)"
			case r.Current:
				end, by = "-", "(current)"
			}
			pod := r.Pod
			if pod != "" && r.Namespace != "" {
				pod = r.Namespace + "/" + pod
			}
			row(tw, r.Pool, r.IP, r.Start.Format(time.RFC3339Nano), end, pod, r.ContainerID, r.IfName, r.Node, by)
		}
	})
}
