package inspect

import (
	"context"
	"errors"
	"fmt"

	"github.com/hashicorp/go-hclog"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/kvstore"
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

// Execute runs the plan's steps in order. A step without guards is one
// kvstore.DeleteAt; a guarded one is one transaction comparing the key's
// revision and every guard. Each key deleted gets an audit line on log.
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
			status, err := in.deleteStep(ctx, st)
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

// deleteStep runs one step. A step whose transaction has an unknown
// outcome (the answer lost, a deadline) is settled as every write is: its
// key is read back, and the step is deleted if the key is gone, not
// applied if it is still there as planned.
func (in *Inspector) deleteStep(ctx context.Context, st Step) (Status, error) {
	status, err := in.tryStep(ctx, st)
	if err == nil || errors.Is(err, kvstore.ErrConflict) {
		return status, err
	}
	resp, rerr := in.cli.Get(ctx, st.Key, clientv3.WithKeysOnly())
	switch {
	case rerr != nil:
		return StatusFailed, fmt.Errorf("%w; its outcome is unknown and the key could not be read back (%v): run the plan again", err, rerr)
	case len(resp.Kvs) == 0:
		return StatusDeleted, nil
	case resp.Kvs[0].ModRevision == st.Rev:
		return StatusFailed, fmt.Errorf("%w; read back: not applied, the key is as planned: run the plan again", err)
	default:
		return StatusFailed, fmt.Errorf("delete %s: changed since the plan (revision %d, now %d): %w", st.Key, st.Rev, resp.Kvs[0].ModRevision, kvstore.ErrConflict)
	}
}

func (in *Inspector) tryStep(ctx context.Context, st Step) (Status, error) {
	if st.History != nil && in.opts.History != nil {
		rec := *st.History
		rec.End = in.now().UTC()
		status := StatusFailed
		err := in.opts.History.Commit(ctx, []etcdstore.HistoryRecord{rec}, func(puts []clientv3.Op) (err error) {
			status, err = in.guardedDelete(ctx, st, puts)
			return err
		})
		return status, err
	}
	if len(st.Guards) == 0 {
		if err := kvstore.DeleteAt(ctx, in.cli, st.Key, st.Rev); err != nil {
			return StatusFailed, err
		}
		return StatusDeleted, nil
	}
	return in.guardedDelete(ctx, st, nil)
}

// guardedDelete deletes st's key in one transaction comparing its revision
// and every guard, with the extra operations then.
func (in *Inspector) guardedDelete(ctx context.Context, st Step, then []clientv3.Op) (Status, error) {
	cmps := []clientv3.Cmp{kvstore.Unchanged(st.Key, st.Rev)}
	reads := []clientv3.Op{clientv3.OpGet(st.Key, clientv3.WithKeysOnly())}
	for _, g := range st.Guards {
		switch {
		case g.Prefix:
			cmps = append(cmps, kvstore.PrefixEmpty(g.Key))
			reads = append(reads, clientv3.OpGet(g.Key, clientv3.WithPrefix(), clientv3.WithCountOnly()))
		case g.Rev == 0:
			cmps = append(cmps, kvstore.Absent(g.Key))
			reads = append(reads, clientv3.OpGet(g.Key, clientv3.WithCountOnly()))
		default:
			cmps = append(cmps, kvstore.Unchanged(g.Key, g.Rev))
			reads = append(reads, clientv3.OpGet(g.Key, clientv3.WithKeysOnly()))
		}
	}
	then = append([]clientv3.Op{clientv3.OpDelete(st.Key)}, then...)
	for _, k := range st.Also {
		then = append(then, clientv3.OpDelete(k))
	}
	resp, err := in.cli.Txn(ctx).If(cmps...).Then(then...).Else(reads...).Commit()
	if err != nil {
		return StatusFailed, fmt.Errorf("delete %s: %w", st.Key, err)
	}
	if resp.Succeeded {
		return StatusDeleted, nil
	}
	return guardFailure(st, resp)
}

// guardFailure explains a guarded delete that did not happen from the Else
// reads: the key itself, then one read per guard.
func guardFailure(st Step, resp *clientv3.TxnResponse) (Status, error) {
	cur := resp.Responses[0].GetResponseRange()
	if len(cur.Kvs) == 0 {
		return StatusGone, nil
	}
	if rev := cur.Kvs[0].ModRevision; rev != st.Rev {
		return StatusFailed, fmt.Errorf("delete %s: changed since the plan (revision %d, now %d): %w", st.Key, st.Rev, rev, kvstore.ErrConflict)
	}
	for i, g := range st.Guards {
		r := resp.Responses[i+1].GetResponseRange()
		switch {
		case g.Prefix && r.Count > 0:
			return StatusFailed, fmt.Errorf("delete %s: %d keys appeared under %s: %w", st.Key, r.Count, g.Key, kvstore.ErrConflict)
		case !g.Prefix && g.Rev == 0 && r.Count > 0:
			return StatusFailed, fmt.Errorf("delete %s: %s exists again (node back or block re-claimed): %w", st.Key, g.Key, kvstore.ErrConflict)
		case !g.Prefix && g.Rev != 0 && (len(r.Kvs) == 0 || r.Kvs[0].ModRevision != g.Rev):
			return StatusFailed, fmt.Errorf("delete %s: %s changed since the plan: %w", st.Key, g.Key, kvstore.ErrConflict)
		}
	}
	return StatusFailed, fmt.Errorf("delete %s: a guard failed: %w", st.Key, kvstore.ErrConflict)
}
