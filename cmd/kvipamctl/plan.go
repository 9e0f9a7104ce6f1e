package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/user"
	"strconv"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/kvipam/kvipam/allocator/inspect"
)

// planReport is what release and node remove print: the plan and, unless
// it was a dry run, what executing it did.
type planReport struct {
	DryRun bool            `json:"dryRun"`
	Plan   inspect.Plan    `json:"plan"`
	Result *inspect.Result `json:"result,omitempty"`
}

// planError adds the flags that answer a refusal: --force for a live
// node, the evidence flags for a node that is not live.
func planError(err error) error {
	var ee *inspect.EvidenceError
	switch {
	case errors.Is(err, inspect.ErrNodeAlive):
		return fmt.Errorf("%w; rerun with --force to go ahead", err)
	case errors.As(err, &ee) && errors.Is(err, inspect.ErrNoEvidence):
		return fmt.Errorf("%w; once you know %s is down for good, rerun with --confirm-gone %s --last-seen TIME (RFC 3339, or how long ago, such as 2h)",
			err, ee.Node, ee.Node)
	case errors.As(err, &ee) && errors.Is(err, inspect.ErrEvidenceContradicted):
		return fmt.Errorf("%w; %s ran later than stated, so it may still be running: check again, and state a later --last-seen only once you know it is down", err, ee.Node)
	}
	return err
}

// planAndApply is an operator command that deletes: the operator's
// evidence from the flags, a snapshot, the plan made from them, then that
// plan applied (or only shown, with --dry-run).
func (a *app) planAndApply(ctx context.Context, w io.Writer, e evidenceFlags, dryRun bool, plan func(*inspect.Snapshot, inspect.Evidence) (inspect.Plan, error)) error {
	ev, err := a.evidence(e)
	if err != nil {
		return err
	}
	in, s, err := a.writeSnapshot(ctx)
	if err != nil {
		return err
	}
	p, err := plan(s, ev)
	if err != nil {
		return planError(err)
	}
	return a.apply(ctx, w, in, p, dryRun)
}

// apply prints the plan (dry run) or executes it with an audit line per
// key on stderr and prints what happened. A failed step is an error.
func (a *app) apply(ctx context.Context, w io.Writer, in *inspect.Inspector, p inspect.Plan, dryRun bool) error {
	rep := planReport{DryRun: dryRun, Plan: p}
	var execErr error
	if !dryRun && len(p.Steps) > 0 {
		log := a.auditLogger().With(evidenceFields(p.Evidence)...)
		log.Info("executing plan", "action", p.Action, "steps", len(p.Steps), "revision", p.Revision, "force", p.Force)
		res, err := in.Execute(ctx, p, log)
		rep.Result, execErr = &res, err
	}
	err := a.render(w, rep, func(tw io.Writer) {
		if len(p.Steps) == 0 {
			fmt.Fprintf(tw, "%s: nothing to do at revision %d\n", p.Action, p.Revision)
			return
		}
		row(tw, "#", "KIND", "KEY", "REV", "STATUS", "NOTE")
		for i, st := range p.Steps {
			status, note := "planned", st.Reason
			if rep.Result != nil {
				o := rep.Result.Outcomes[i]
				status = string(o.Status)
				if o.Error != "" {
					note = o.Error
				}
			}
			row(tw, i+1, st.Kind, st.Key, st.Rev, status, note)
		}
		if ev := p.Evidence; ev != nil {
			fmt.Fprintf(tw, "evidence: %s states %s is gone, last seen %s (stated %s)\n",
				cmp.Or(ev.StatedBy, "the operator"), ev.ConfirmGone, ev.LastSeen.Format(time.RFC3339), ev.StatedAt.Format(time.RFC3339))
		}
		if rep.Result == nil {
			fmt.Fprintf(tw, "dry run of %s: %d keys would be deleted (as of revision %d); nothing changed\n", p.Action, len(p.Steps), p.Revision)
		} else {
			fmt.Fprintf(tw, "%s: %d keys deleted, %d failed, %d skipped\n", p.Action, rep.Result.Deleted, rep.Result.Failed, rep.Result.Skipped)
		}
	})
	if err != nil {
		return err
	}
	return execErr
}

// evidenceFields are the audit log fields of a plan's evidence (node
// remove, or a release of a node that is not alive); the operator who
// stated it is already on every line.
func evidenceFields(ev *inspect.Evidence) []any {
	if ev == nil {
		return nil
	}
	return []any{"confirmGone", ev.ConfirmGone, "lastSeen", ev.LastSeen.Format(time.RFC3339Nano), "statedAt", ev.StatedAt.Format(time.RFC3339)}
}

// auditLogger logs every deleted key on stderr, naming the operator.
func (a *app) auditLogger() hclog.Logger {
	return hclog.New(&hclog.LoggerOptions{
		Name: "kvipamctl.audit", Output: a.stderr, Level: hclog.Info, TimeFormat: time.RFC3339,
	}).With("operator", a.operator())
}

// operator names who runs kvipamctl: $USER, else the login name of the
// process's uid (cron jobs, containers and `env -i` have no $USER), else
// uid=N.
func (a *app) operator() string {
	if u := a.getenv("USER"); u != "" {
		return u
	}
	uid := strconv.Itoa(os.Getuid())
	if u, err := user.LookupId(uid); err == nil && u.Username != "" {
		return u.Username
	}
	return "uid=" + uid
}
