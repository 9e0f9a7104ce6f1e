package agent

import (
	"context"
	"time"

	"github.com/cenkalti/backoff/v4"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// keepLease watches the node lease. When it is lost (etcd unreachable past
// the TTL, or the lease revoked), allocations fail fast with "try again"
// until a new lease is granted and the node's blocks are re-claimed on it;
// running pods keep their addresses throughout, since allocations carry no
// lease. Pods whose addresses were freed meanwhile (kvipamctl node remove)
// are reported as lost endpoints (recheckEndpoints).
func (a *Agent) keepLease(ctx context.Context) {
	for {
		sess := a.session()
		select {
		case <-ctx.Done():
			return
		case <-sess.Done():
		}
		a.log.Warn("node lease lost; allocations answer try-again until it is re-established", "lease", sess.ID())
		a.setSession(nil)
		sess.Close()
		b := backoff.NewExponentialBackOff()
		b.InitialInterval, b.MaxInterval, b.MaxElapsedTime = 200*time.Millisecond, 5*time.Second, 0
		for {
			if ok := a.renewLease(ctx); ok {
				break
			}
			select {
			case <-ctx.Done():
				return
			case <-time.After(b.NextBackOff()):
			}
		}
	}
}

func (a *Agent) renewLease(ctx context.Context) bool {
	rctx, cancel := context.WithTimeout(ctx, a.cfg.RequestTimeout.Duration)
	defer cancel()
	sess, err := a.newSession(rctx)
	if err != nil {
		a.log.Debug("renew lease", "error", err)
		return false
	}
	if err := a.alloc.Restore(rctx, sess); err != nil {
		a.log.Warn("re-claim blocks on the new lease", "error", err)
		sess.Close()
		return false
	}
	a.setSession(sess)
	a.log.Info("node lease re-established; blocks re-claimed", "lease", sess.ID())
	a.recheckEndpoints(rctx)
	return true
}

// probeEtcd checks etcd once a second, so a request can be refused at once
// when etcd is known to be down instead of waiting out its timeout.
func (a *Agent) probeEtcd(ctx context.Context) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		pctx, cancel := context.WithTimeout(ctx, time.Second)
		_, err := a.cli.Get(pctx, "/kvipam/v1/health", clientv3.WithCountOnly())
		cancel()
		if ctx.Err() != nil {
			return
		}
		a.mu.Lock()
		changed := (a.etcdErr == nil) != (err == nil)
		a.etcdErr = err
		a.mu.Unlock()
		if changed && err != nil {
			a.log.Warn("etcd unreachable", "error", err)
		} else if changed {
			a.log.Info("etcd reachable again")
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
