package kvstore

import (
	"context"
	"fmt"
	"sync"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// Session is one etcd lease kept alive for as long as the process holds it.
// Keys written with the session's lease (node record, block claims) vanish
// when the process is gone for longer than the TTL.
//
// Done is closed when the lease is lost: the keepalive stream ended because
// etcd expired or revoked the lease, or because etcd was unreachable for
// longer than the TTL, or because Close was called. A lost session is never
// revived; the owner grants a new one and re-establishes its keys.
// Session is safe for concurrent use.
type Session struct {
	cli    *clientv3.Client
	id     clientv3.LeaseID
	ttl    int64
	cancel context.CancelFunc
	done   chan struct{}
	once   sync.Once
}

// NewSession grants a lease of ttlSeconds and keeps it alive in the
// background. ctx bounds only the grant. An etcd that does not answer makes
// the error wrap ErrUnavailable.
func NewSession(ctx context.Context, cli *clientv3.Client, ttlSeconds int64) (*Session, error) {
	if ttlSeconds < 1 {
		return nil, fmt.Errorf("kvstore: lease ttl %ds must be at least 1s", ttlSeconds)
	}
	resp, err := cli.Grant(ctx, ttlSeconds)
	if err != nil {
		return nil, fmt.Errorf("grant lease: %w", Unavailable(err))
	}
	kctx, cancel := context.WithCancel(context.Background())
	ch, err := cli.KeepAlive(kctx, resp.ID)
	if err != nil {
		cancel()
		return nil, fmt.Errorf("keep lease %x alive: %w", resp.ID, Unavailable(err))
	}
	s := &Session{cli: cli, id: resp.ID, ttl: resp.TTL, cancel: cancel, done: make(chan struct{})}
	go func() {
		defer s.markDone()
		for range ch {
			// Each response is a renewal; the channel closes when the
			// lease is gone or kctx ends.
		}
	}()
	return s, nil
}

func (s *Session) markDone() { s.once.Do(func() { close(s.done) }) }

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

// Close stops the keepalive without revoking the lease: keys on it live out
// their TTL, so a process that restarts quickly can take them over.
func (s *Session) Close() {
	s.cancel()
	<-s.done
}

// Revoke ends the lease at once, deleting every key attached to it.
func (s *Session) Revoke(ctx context.Context) error {
	s.cancel()
	<-s.done
	if _, err := s.cli.Revoke(ctx, s.id); err != nil {
		return fmt.Errorf("revoke lease %x: %w", s.id, Unavailable(err))
	}
	return nil
}

// ID is the lease ID as a plain integer, for consumers that do not import
// etcd (the allocator's Lease interface).
func (s *Session) ID() int64 { return int64(s.id) }
