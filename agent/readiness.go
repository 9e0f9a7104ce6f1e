package agent

import (
	"errors"
	"fmt"
	"sync"
)

// readinessState is what the API asks before it serves a request: whether
// the agent can allocate now (nil) and why not, and whether it knows its
// allocations (enough to release).
type readinessState interface {
	readyErr() error
	isRestored() bool
}

// readiness is whether the agent can serve, and why not: the node's name
// its own, its state restored (or why the last restore failed), etcd
// reachable, the node lease held. It is safe for concurrent use.
type readiness struct {
	name  interface{ err() error }
	probe interface{ lastErr() error }
	lease interface{ live() bool }

	mu       sync.Mutex
	restored bool
	// restoreErr is why the last restore failed, while not restored.
	restoreErr error
}

var _ readinessState = (*readiness)(nil)

// readyErr reports whether the agent can allocate now, and why not. A
// name taken by another agent comes first: it does not pass by itself.
func (r *readiness) readyErr() error {
	if err := r.name.err(); err != nil {
		return err
	}
	r.mu.Lock()
	restored, restoreErr := r.restored, r.restoreErr
	r.mu.Unlock()
	switch {
	case !restored && restoreErr != nil:
		return fmt.Errorf("restore failed, retrying: %w", restoreErr)
	case !restored:
		return errors.New("agent is restoring its state")
	}
	if err := r.probe.lastErr(); err != nil {
		return fmt.Errorf("etcd unreachable: %w", err)
	}
	if !r.lease.live() {
		return errors.New("node lease lost; re-establishing")
	}
	return nil
}

func (r *readiness) isRestored() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.restored
}

// restoreDone records a restore's outcome: restored, or why not yet.
func (r *readiness) restoreDone(err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err == nil {
		r.restored, r.restoreErr = true, nil
		return
	}
	r.restoreErr = err
}
