package agent

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"
)

// resyncEvery is how often a sync loop runs unkicked: to retry what
// failed and to repair what someone else undid.
const resyncEvery = 30 * time.Second

// syncLoop keeps something outside the agent (the kernel's peer routes, a
// BGP speaker's announcements) equal to what the agent's watches say. Its
// watches kick it on every change; it also runs every resyncEvery.
type syncLoop struct {
	what string // "peer routes", "bgp announcements"
	log  hclog.Logger
	kick chan struct{}
	// passes counts the loop's passes (a sync, or a wait for the first
	// lists); tests wait on it.
	passes atomic.Int64
}

func newSyncLoop(what string, log hclog.Logger) syncLoop {
	return syncLoop{what: what, log: log, kick: make(chan struct{}, 1)}
}

// changed wakes the loop.
func (l *syncLoop) changed() { kick(l.kick) }

// run calls sync on every kick and tick until ctx ends. sync says ran
// false while the desired state is not known (its watches have not
// listed): syncing then would remove what the next pass puts back. Every
// failure is logged, and the first success once, as "<what> in sync":
// tests and operators wait on that line.
func (l *syncLoop) run(ctx context.Context, sync func() (ran bool, err error)) {
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
