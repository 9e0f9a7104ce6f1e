package kvstore

import (
	"context"
	"fmt"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// Session is one etcd lease kept alive for as long as the process holds it.
// Keys written with the session's lease (node record, block claims) vanish
// when the process is gone for longer than the TTL.
//
// The session knows until when etcd keeps the lease at the least
// (HeldUntil): etcd renews a lease to a full TTL when it handles a
// keepalive, which is after the keepalive was sent, so the send time of
// the last keepalive etcd answered, plus the TTL, comes no later than etcd
// can expire the lease (a leader change only extends leases). Done is
// closed at that time if no later keepalive was answered by then, when
// etcd says the lease is gone (revoked or expired), or on Close: a lost
// session is one the process can no longer prove it holds, and it says so
// before etcd can give its keys away. etcd's own client keeps a lease
// alive until the last answer's arrival plus the TTL, later than etcd may
// expire it, and checks that once a second; the sessions of a client send
// their own keepalives, on one stream whose keeper knows the send times
// (keeper).
//
// A lost session is never revived; the owner grants a new one and
// re-establishes its keys. Session is safe for concurrent use.
type Session struct {
	cli     *clientv3.Client
	id      clientv3.LeaseID
	ttl     int64
	every   time.Duration // between keepalives, and how long one may go unanswered
	cancel  context.CancelFunc
	stopped chan struct{} // the keepalive loop ended
	done    chan struct{}
	once    sync.Once

	mu      sync.Mutex
	until   time.Time     // etcd keeps the lease at least until then
	moved   chan struct{} // closed when until moves or the session is lost
	expires *time.Timer   // closes done at until
}

// keepaliveRetry is how soon a keepalive that failed is sent again.
const keepaliveRetry = 500 * time.Millisecond

// NewSession grants a lease of ttlSeconds and keeps it alive in the
// background: a keepalive every third of the TTL, each abandoned and sent
// again if it is not answered within a third of the TTL. ctx bounds only
// the grant. An etcd that does not answer makes the error wrap
// retry.ErrUnavailable.
func NewSession(ctx context.Context, cli *clientv3.Client, ttlSeconds int64) (*Session, error) {
	if ttlSeconds < 1 {
		return nil, fmt.Errorf("kvstore: lease ttl %ds must be at least 1s", ttlSeconds)
	}
	sent := time.Now()
	resp, err := cli.Grant(ctx, ttlSeconds)
	if err != nil {
		return nil, fmt.Errorf("grant lease: %w", Unavailable(err))
	}
	kctx, cancel := context.WithCancel(context.Background())
	s := &Session{cli: cli, id: resp.ID, ttl: resp.TTL, every: seconds(resp.TTL) / 3, cancel: cancel, stopped: make(chan struct{}), done: make(chan struct{}),
		until: sent.Add(seconds(resp.TTL)), moved: make(chan struct{})}
	s.expires = time.AfterFunc(time.Until(s.until), s.markDone)
	go s.keepAlive(kctx)
	return s, nil
}

func seconds(n int64) time.Duration { return time.Duration(n) * time.Second }

// keepAlive renews the lease until ctx ends or the lease is lost: a
// keepalive every third of the TTL on the client's keepalive stream, sent
// again soon if it is not answered within a third of the TTL. The keeper
// moves HeldUntil when the answer comes, however late.
func (s *Session) keepAlive(ctx context.Context) {
	defer close(s.stopped)
	k := keeperOf(s.cli)
	defer k.release()
	wait := s.every
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.done:
			return
		case <-time.After(wait):
		}
		_, moved := s.HeldUntil()
		if !k.send(ctx, s) {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-moved:
			wait = s.every
		case <-time.After(s.every):
			wait = keepaliveRetry // unanswered: try again soon, until done
		}
	}
}

// extend moves HeldUntil to until, if later, unless the session is lost.
func (s *Session) extend(until time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.Lost() || !until.After(s.until) {
		return
	}
	s.until = until
	s.expires.Reset(time.Until(until))
	close(s.moved)
	s.moved = make(chan struct{})
}

func (s *Session) markDone() {
	s.once.Do(func() {
		close(s.done)
		s.mu.Lock()
		close(s.moved)
		s.moved = make(chan struct{})
		s.mu.Unlock()
	})
}

// Lease is the session's lease ID, to attach keys with clientv3.WithLease.
func (s *Session) Lease() clientv3.LeaseID { return s.id }

// TTL is the lease TTL in seconds as granted by etcd.
func (s *Session) TTL() int64 { return s.ttl }

// Done is closed once the lease can no longer be relied on.
func (s *Session) Done() <-chan struct{} { return s.done }

// Lost reports whether Done is closed.
func (s *Session) Lost() bool {
	select {
	case <-s.done:
		return true
	default:
		return false
	}
}

// HeldUntil is the time until which etcd keeps the lease at the least
// (zero once the session is lost), and a channel closed when that time
// moves on (a keepalive was answered) or the session is lost.
func (s *Session) HeldUntil() (time.Time, <-chan struct{}) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.Lost() {
		return time.Time{}, s.moved
	}
	return s.until, s.moved
}

// Close stops the keepalive without revoking the lease: keys on it live out
// their TTL, so a process that restarts quickly can take them over.
func (s *Session) Close() {
	s.cancel()
	<-s.stopped
	s.expires.Stop()
	s.markDone()
}

// Revoke ends the lease at once, deleting every key attached to it.
func (s *Session) Revoke(ctx context.Context) error {
	s.Close()
	if _, err := s.cli.Revoke(ctx, s.id); err != nil {
		return fmt.Errorf("revoke lease %x: %w", s.id, Unavailable(err))
	}
	return nil
}

// ID is the lease ID as a plain integer, for consumers that do not import
// etcd (the allocator's Lease interface).
func (s *Session) ID() int64 { return int64(s.id) }
