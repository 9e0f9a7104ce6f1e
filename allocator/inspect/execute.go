package inspect

import (
	"context"
	"errors"
	"fmt"

	"github.com/hashicorp/go-hclog"

	"github.com/kvipam/kvipam/allocator/etcdstore"
)

// Status is what executing a step did.
type Status string

// Statuses of executed steps.
const (
	// StatusDeleted: the key is gone now (an unguarded delete cannot tell
	// whether it was already gone).
	StatusDeleted Status = "deleted"
	// StatusGone: a guarded delete found the key already gone.
	StatusGone Status = "gone"
	// StatusFailed: the key changed since the plan, a guard failed, or
	// etcd could not be reached. Nothing was deleted.
	StatusFailed Status = "failed"
	// StatusSkipped: an earlier step of the same group failed.
	StatusSkipped Status = "skipped"
)

// Outcome is one executed step.
type Outcome struct {
	Step
	Status Status `json:"status"`
	Error  string `json:"error,omitempty"`
}

// Result is what Execute did, step by step.
type Result struct {
	Outcomes []Outcome `json:"outcomes"`
	Deleted  int       `json:"deleted"`
	Failed   int       `json:"failed"`
	Skipped  int       `json:"skipped"`
}

// Execute runs the plan's steps in order, each one etcdstore.Operator.DeleteGuarded:
// one transaction comparing the key's revision and every guard. Each key deleted gets an audit line on log.
// Execute goes on after a failed step, skipping only the rest of its
// group, and returns an error joining the failures; running the plan again
// is safe. ctx bounds the whole run.
func (in *Inspector) Execute(ctx context.Context, p Plan, log hclog.Logger) (Result, error) {
	if log == nil {
		log = hclog.NewNullLogger()
	}
	res := Result{Outcomes: make([]Outcome, 0, len(p.Steps))}
	failedGroups := map[string]bool{}
	var errs []error
	for _, st := range p.Steps {
		o := Outcome{Step: st}
		switch {
		case st.Group != "" && failedGroups[st.Group]:
			o.Status, o.Error = StatusSkipped, "an earlier step of "+st.Group+" failed"
			res.Skipped++
		case ctx.Err() != nil:
			o.Status, o.Error = StatusSkipped, ctx.Err().Error()
			res.Skipped++
		default:
			status, err := in.runStep(ctx, st)
			o.Status = status
			if err != nil {
				o.Error = err.Error()
				errs = append(errs, err)
				res.Failed++
				if st.Group != "" {
					failedGroups[st.Group] = true
				}
				log.Warn("delete refused", "action", p.Action, "key", st.Key, "rev", st.Rev, "error", err)
				break
			}
			res.Deleted++
			log.Info("deleted key", "action", p.Action, "key", st.Key, "rev", st.Rev, "kind", st.Kind,
				"node", st.Node, "owner", st.Owner, "reason", st.Reason, "status", status)
		}
		res.Outcomes = append(res.Outcomes, o)
	}
	if len(errs) > 0 {
		return res, fmt.Errorf("%s: %d of %d steps failed, %d skipped: %w", p.Action, res.Failed, len(p.Steps), res.Skipped, errors.Join(errs...))
	}
	return res, nil
}

// runStep runs one step through etcdstore.Operator.DeleteGuarded (or,
// for StepAlternate, DropAlternateGuarded), which also settles a
// transaction of unknown outcome (the answer lost, a deadline) as every
// write is: by reading the key back.
func (in *Inspector) runStep(ctx context.Context, st Step) (Status, error) {
	var gone bool
	var err error
	if st.Kind == StepAlternate {
		gone, err = in.st.DropAlternateGuarded(ctx, in.opts.History, etcdstore.GuardedAlternateDrop{
			Pool: st.Pool, Binding: st.Key, Rev: st.Rev, Owner: st.Owner, Node: st.Node,
			Records: st.Rewrite, Guards: st.Guards, Reason: etcdstore.EndNodeRemove, End: in.now()})
	} else {
		d := etcdstore.GuardedDelete{Key: st.Key, Rev: st.Rev, Guards: st.Guards, Also: st.Also}
		if st.History != nil {
			rec := *st.History
			rec.End = in.now().UTC()
			d.History = &rec
		}
		gone, err = in.st.DeleteGuarded(ctx, in.opts.History, d)
	}
	switch {
	case err != nil:
		return StatusFailed, err
	case gone:
		return StatusGone, nil
	default:
		return StatusDeleted, nil
	}
}
