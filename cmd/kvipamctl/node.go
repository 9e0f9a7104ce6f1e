package main

import (
	"context"
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/kvipam/kvipam/allocator/inspect"
)

func (a *app) nodeCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "node", Short: "List nodes and remove dead ones"}
	list := &cobra.Command{
		Use:   "list",
		Short: "List nodes: alive (node record present) or only named by claims, homes and addresses",
		Args:  cobra.NoArgs,
		RunE:  func(cmd *cobra.Command, _ []string) error { return a.nodeList(cmd.Context(), a.stdout) },
	}
	var r nodeRemoveRequest
	remove := &cobra.Command{
		Use:   "remove NODE --confirm-gone NODE --last-seen TIME",
		Short: "Free the blocks of a node that is gone",
		Long: `Free the blocks of a node that is gone for good: delete its claims, the
allocations in its blocks, then the blocks' homes, so any node can claim
them again. This is the audited release of orphaned blocks (invariant 3).
A sticky identity whose addresses go (kept for it, or its pod's) loses its
binding too, so its next pod gets new addresses. A VM's live migration
whose target pod (its second owner) ran on the node ends: the binding and
the address records lose that owner, and the source pod's DEL, refused
while the target's node is away, goes through.

A missing node record is not proof that the node is gone: a node cut off
from etcd for longer than its lease TTL loses its node record and claims
the same way, while its pods keep using their addresses. So you must state
it: --confirm-gone repeats the node's name, and --last-seen says when it
last ran, as an RFC 3339 time or as how long ago (2h, 90m). The command is
refused when etcd shows the node alive after that time (an allocation it
wrote, a claim it made, its home or node record), and the statement goes
into the plan and every audit line.

Refused while the node record exists (the agent is alive) unless --force.
Every delete is fenced: if the node comes back and re-claims a block while
this runs, the rest of that block is left alone. --dry-run prints the plan
and changes nothing. Run it again after a partial failure.`,
		Example: `  kvipamctl node remove worker-7 --confirm-gone worker-7 --last-seen 2026-01-22T07:40:00Z --dry-run
  kvipamctl node remove worker-7 --confirm-gone worker-7 --last-seen 3h`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			r.node = args[0]
			return a.nodeRemove(cmd.Context(), a.stdout, r)
		},
	}
	r.evidence.register(remove)
	f := remove.Flags()
	f.BoolVar(&r.dryRun, "dry-run", false, "print the plan, change nothing")
	f.BoolVar(&r.force, "force", false, "remove a node whose node record exists")
	cmd.AddCommand(list, remove)
	return cmd
}

func (a *app) nodeList(ctx context.Context, w io.Writer) error {
	_, s, err := a.snapshot(ctx)
	if err != nil {
		return err
	}
	rows := inspect.Nodes(s)
	return a.render(w, rows, func(tw io.Writer) {
		row(tw, "NODE", "ALIVE", "BOOT-ID", "ADDRESSES", "VERSION", "LABELS", "CLAIMS", "HOMES", "IPS")
		for _, r := range rows {
			row(tw, r.Node, r.Alive, r.BootID, strings.Join(r.Addresses, ","), r.Version, labelsCell(r.Labels), r.Claims, r.Homes, r.IPs)
		}
	})
}

// labelsCell writes a node's labels as --node-labels takes them, sorted:
// "rack=r1,zone=a"; "" (a dash) for none.
func labelsCell(labels map[string]string) string {
	kv := make([]string, 0, len(labels))
	for _, k := range slices.Sorted(maps.Keys(labels)) {
		kv = append(kv, k+"="+labels[k])
	}
	return strings.Join(kv, ",")
}

// nodeRemoveRequest is what node remove was asked, with the evidence as
// typed.
type nodeRemoveRequest struct {
	node          string
	evidence      evidenceFlags
	dryRun, force bool
}

func (a *app) nodeRemove(ctx context.Context, w io.Writer, r nodeRemoveRequest) error {
	return a.planAndApply(ctx, w, r.evidence, r.dryRun, func(s *inspect.Snapshot, ev inspect.Evidence) (inspect.Plan, error) {
		return inspect.PlanNodeRemove(s, r.node, ev, r.force)
	})
}

// evidenceFlags are the flags by which an operator states that a node is
// gone (inspect.Evidence): node remove and release take them alike.
type evidenceFlags struct {
	confirmGone, lastSeen string
}

func (e *evidenceFlags) register(cmd *cobra.Command) {
	f := cmd.Flags()
	f.StringVar(&e.confirmGone, "confirm-gone", "", "the node's name again: you state that it is down for good")
	f.StringVar(&e.lastSeen, "last-seen", "", "when the node last ran: an RFC 3339 time, or how long ago (2h, 90m)")
}

// evidence is the statement the flags make, by the operator, now.
func (a *app) evidence(e evidenceFlags) (inspect.Evidence, error) {
	now := a.now().UTC()
	ev := inspect.Evidence{ConfirmGone: e.confirmGone, StatedBy: a.operator(), StatedAt: now}
	if e.lastSeen != "" {
		t, err := parseLastSeen(e.lastSeen, now)
		if err != nil {
			return inspect.Evidence{}, err
		}
		ev.LastSeen = t
	}
	return ev, nil
}

// parseLastSeen reads --last-seen: an RFC 3339 time (fractional seconds
// allowed), or a duration before now such as 2h or 90m.
func parseLastSeen(v string, now time.Time) (time.Time, error) {
	return parseWhen("--last-seen", v, now)
}

// parseWhen reads a time flag: an RFC 3339 time, or how long ago.
func parseWhen(flag, v string, now time.Time) (time.Time, error) {
	if t, err := time.Parse(time.RFC3339, v); err == nil {
		return t.UTC(), nil
	}
	d, err := time.ParseDuration(v)
	if err != nil || d < 0 {
		return time.Time{}, fmt.Errorf("parse %s %q: want an RFC 3339 time (2026-01-22T07:40:00Z) or how long ago (2h, 90m)", flag, v)
	}
	return now.Add(-d), nil
}
