// Package syncloop keeps something outside the process (the kernel's peer
// routes, a BGP speaker's announcements, masquerade rules) equal to what
// watches of etcd say: the watches kick a Loop on every change, and it
// also runs every 30 s, to retry what failed and to repair what someone
// else undid.
package syncloop

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"
)

// resyncEvery is how often a sync loop runs unkicked: to retry what
// failed and to repair what someone else undid.
const resyncEvery = 30 * time.Second

// Loop keeps one thing equal to what its watches say. Its watches kick it
// on every change (Changed, or a Kick of Wake); it also runs every
// resyncEvery.
type Loop struct {
	what string // "peer routes", "bgp announcements"
	log  hclog.Logger
	kick chan struct{}
	// passes counts the loop's passes (a sync, or a wait for the first
	// lists); tests wait on it.
	passes atomic.Int64
}

// New is a loop that keeps what (named in its log lines) in sync.
func New(what string, log hclog.Logger) Loop {
	return Loop{what: what, log: log, kick: make(chan struct{}, 1)}
}

// Changed wakes the loop.
func (l *Loop) Changed() { Kick(l.kick) }

// Wake is the channel that wakes the loop, for a watch that kicks a
// channel of its own (Kick).
func (l *Loop) Wake() chan<- struct{} { return l.kick }

// Passes counts the loop's passes (a sync, or a wait for the first
// lists); tests wait on it.
func (l *Loop) Passes() int64 { return l.passes.Load() }

// Run calls sync on every kick and tick until ctx ends. sync says ran
// false while the desired state is not known (its watches have not
// listed): syncing then would remove what the next pass puts back. Every
// failure is logged, and the first success once, as "<what> in sync":
// tests and operators wait on that line.
func (l *Loop) Run(ctx context.Context, sync func() (ran bool, err error)) {
	t := time.NewTicker(resyncEvery)
	defer t.Stop()
	synced := false
	for {
		select {
		case <-ctx.Done():
			return
		case <-l.kick:
		case <-t.C:
		}
		ran, err := sync()
		switch {
		case err != nil:
			l.log.Warn(l.what, "error", err)
		case ran && !synced:
			synced = true
			l.log.Info(l.what + " in sync")
		}
		l.passes.Add(1)
	}
}

// Kick wakes a loop that waits on ch, unless it is already woken.
func Kick(ch chan<- struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}
