package agent

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/kvstore"
)

// leaseKeeper holds the node's etcd lease. When it is lost (etcd
// unreachable past the TTL, or the lease revoked), allocations fail fast
// with "try again" until a new lease is granted and the node's blocks are
// re-claimed on it; running pods keep their addresses throughout, since
// allocations carry no lease. It is safe for concurrent use.
type leaseKeeper struct {
	// leases grants a new lease and writes the node record on it.
	leases interface {
		grant(ctx context.Context) (*kvstore.Session, error)
	}
	// alloc re-claims the node's blocks on a new lease.
	alloc interface {
		Restore(ctx context.Context, lease nodealloc.Lease) error
	}
	// renewed, if set, is told when a lost lease was replaced and the
	// blocks re-claimed (pods whose addresses went elsewhere meanwhile
	// are reported then).
	renewed interface{ leaseRenewed(ctx context.Context) }
	// name says whether the node's name may be taken: a new lease waits
	// while another incarnation's record is contested, and none is
	// taken once the name is another agent's (identity.go).
	name interface {
		settle(ctx context.Context) error
	}
	timeout time.Duration
	held    prometheus.Gauge
	log     hclog.Logger

	mu      sync.Mutex
	sess    *kvstore.Session
	changed chan struct{} // closed and replaced when sess changes
	// retaking is set while a lease is given up to take the node's
	// name back on a new one (retake).
	retaking bool
}

// session is the current lease, nil while none is held.
func (k *leaseKeeper) session() *kvstore.Session {
	s, _ := k.Current()
	return s
}

// Current is the current lease (nil while none is held) and a channel
// closed when the keeper holds another: a lost lease dropped, or a new
// one set once the node's blocks are re-claimed on it (the BGP announcer,
// routing.Announcer, follows it: routing.Lease).
func (k *leaseKeeper) Current() (*kvstore.Session, <-chan struct{}) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.changed == nil {
		k.changed = make(chan struct{})
	}
	return k.sess, k.changed
}

func (k *leaseKeeper) set(s *kvstore.Session) {
	k.mu.Lock()
	k.sess = s
	if s != nil {
		k.retaking = false // the name is taken back
	}
	if k.changed != nil {
		close(k.changed)
	}
	k.changed = make(chan struct{})
	k.mu.Unlock()
	held := 0.0
	if s != nil {
		held = 1
	}
	k.held.Set(held)
}

// live reports whether a live lease is held now.
func (k *leaseKeeper) live() bool {
	s := k.session()
	return s != nil && !s.Lost()
}

// ensure returns a live session, granting a new one if the last was lost.
func (k *leaseKeeper) ensure(ctx context.Context) (*kvstore.Session, error) {
	if s := k.session(); s != nil && !s.Lost() {
		return s, nil
	}
	s, err := k.leases.grant(ctx)
	if err != nil {
		return nil, err
	}
	if old := k.session(); old != nil {
		old.Close()
	}
	k.set(s)
	return s, nil
}

// run watches the lease until ctx ends, replacing it whenever it is lost.
func (k *leaseKeeper) run(ctx context.Context) {
	for {
		sess := k.session()
		if sess == nil {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-sess.Done():
		}
		k.mu.Lock()
		retaking := k.retaking
		k.retaking = false
		k.mu.Unlock()
		if retaking {
			k.log.Info("node lease given up to take the node's name back on a new one", "lease", sess.ID())
		} else {
			k.log.Warn("node lease lost; allocations answer try-again until it is re-established", "lease", sess.ID())
		}
		k.set(nil)
		sess.Close()
		b := backoff.NewExponentialBackOff()
		b.InitialInterval, b.MaxInterval, b.MaxElapsedTime = 200*time.Millisecond, 5*time.Second, 0
		for {
			// No lease while another incarnation's record is contested,
			// and none ever once another agent holds the name.
			if err := k.name.settle(ctx); err != nil {
				return
			}
			err := k.renew(ctx)
			if err == nil {
				break
			}
			if errors.Is(err, etcdstore.ErrNodeTaken) || errors.Is(err, errNameContested) {
				b.Reset() // the name guard decides; settle waits for it
				continue
			}
			select {
			case <-ctx.Done():
				return
			case <-time.After(b.NextBackOff()):
			}
		}
	}
}

// retake gives up a live lease without revoking it, so that run takes
// the node's name back on a new one as after any lost lease: its record
// written, its blocks re-claimed (from the old lease too) and its
// endpoints checked. Without a live lease, run is already on its way.
func (k *leaseKeeper) retake() {
	k.mu.Lock()
	s := k.sess
	live := s != nil && !s.Lost()
	k.retaking = live
	k.mu.Unlock()
	if live {
		s.Close()
	}
}

func (k *leaseKeeper) renew(ctx context.Context) error {
	rctx, cancel := context.WithTimeout(ctx, k.timeout)
	defer cancel()
	sess, err := k.leases.grant(rctx)
	if err != nil {
		k.log.Debug("renew lease", "error", err)
		return err
	}
	if err := k.alloc.Restore(rctx, sess); err != nil {
		k.log.Warn("re-claim blocks on the new lease", "error", err)
		sess.Close()
		return err
	}
	k.set(sess)
	k.log.Info("node lease re-established; blocks re-claimed", "lease", sess.ID())
	if k.renewed != nil {
		k.renewed.leaseRenewed(rctx)
	}
	return nil
}

// close ends the lease keeper's hold without revoking: claims live out
// their TTL, so a quick restart finds them.
func (k *leaseKeeper) close() {
	if s := k.session(); s != nil {
		s.Close()
	}
}

// etcdProbe checks etcd once a second, so a request can be refused at once
// when etcd is known to be down instead of waiting out its timeout.
type etcdProbe struct {
	store interface {
		Ping(ctx context.Context) error
	}
	log hclog.Logger
	// back, if set, is told when etcd answers again after it did not: it
	// may have been restored from a snapshot meanwhile.
	back interface{ etcdBack(ctx context.Context) }

	mu  sync.Mutex
	err error
}

func (p *etcdProbe) run(ctx context.Context) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		pctx, cancel := context.WithTimeout(ctx, time.Second)
		err := p.store.Ping(pctx)
		cancel()
		if ctx.Err() != nil {
			return
		}
		p.mu.Lock()
		changed := (p.err == nil) != (err == nil)
		p.err = err
		p.mu.Unlock()
		if changed && err != nil {
			p.log.Warn("etcd unreachable", "error", err)
		} else if changed {
			p.log.Info("etcd reachable again")
			if p.back != nil {
				rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
				p.back.etcdBack(rctx)
				cancel()
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// lastErr is the last probe's error; nil when etcd answered.
func (p *etcdProbe) lastErr() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.err
}
