package kvstore

import (
	"context"
	"fmt"
	"sync"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
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
// expire it, and checks that once a second; the session keeps its own
// keepalives to know the send times.
//
// A lost session is never revived; the owner grants a new one and
// re-establishes its keys. Session is safe for concurrent use.
type Session struct {
	cli     *clientv3.Client
	id      clientv3.LeaseID
	ttl     int64
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
	s := &Session{cli: cli, id: resp.ID, ttl: resp.TTL, cancel: cancel, stopped: make(chan struct{}), done: make(chan struct{}),
		until: sent.Add(seconds(resp.TTL)), moved: make(chan struct{})}
	s.expires = time.AfterFunc(time.Until(s.until), s.markDone)
	go s.keepAlive(kctx)
	return s, nil
}

func seconds(n int64) time.Duration { return time.Duration(n) * time.Second }

// keepAlive renews the lease until ctx ends or the lease is lost. The
// keepalives go on one long-lived LeaseKeepAlive stream, opened again
// after an error, with one keepalive in flight at a time, so an answer is
// the answer to the keepalive last sent and its send time is known. (A
// stream a keepalive, as clientv3's KeepAliveOnce opens, cost a
// three-member cluster its leader with 2,500 sessions in one process.)
func (s *Session) keepAlive(ctx context.Context) {
	defer close(s.stopped)
	every := seconds(s.ttl) / 3
	wait := every
	var st *keepaliveStream
	defer func() { st.close() }()
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.done:
			return
		case <-time.After(wait):
		}
		if st == nil {
			st = openKeepalive(ctx, s.cli)
		}
		sent := time.Now()
		ttl, err := st.renew(s.id, every)
		switch {
		case err != nil:
			st.close() // unanswered: a new stream, soon, until done
			st = nil
			wait = keepaliveRetry
		case ttl <= 0:
			s.markDone() // etcd expired or revoked it
			return
		default:
			s.extend(sent.Add(seconds(ttl)))
			wait = every
		}
	}
}

// keepaliveStream is one LeaseKeepAlive stream, on whichever member the
// client's balancer picks. It requires a leader: a member cut off from
// its cluster ends the stream rather than holding keepalives it cannot
// forward, and the next stream may go to another member.
type keepaliveStream struct {
	ctx    context.Context
	cancel context.CancelFunc
	stream pb.Lease_LeaseKeepAliveClient
	err    error // the stream could not be opened
}

func openKeepalive(ctx context.Context, cli *clientv3.Client) *keepaliveStream {
	sctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	st := &keepaliveStream{ctx: sctx, cancel: cancel}
	st.stream, st.err = pb.NewLeaseClient(cli.ActiveConnection()).LeaseKeepAlive(sctx)
	return st
}

// renew sends one keepalive and awaits its answer for at most timeout
// (the stream is cancelled then, and unusable). A TTL of zero or less is
// etcd's answer for a lease it does not have.
func (st *keepaliveStream) renew(id clientv3.LeaseID, timeout time.Duration) (int64, error) {
	if st.err != nil {
		return 0, st.err
	}
	abandon := time.AfterFunc(timeout, st.cancel)
	defer abandon.Stop()
	if err := st.stream.Send(&pb.LeaseKeepAliveRequest{ID: int64(id)}); err != nil {
		return 0, err
	}
	resp, err := st.stream.Recv()
	if err != nil {
		return 0, err
	}
	if st.ctx.Err() != nil {
		return 0, st.ctx.Err() // answered as the timeout fired: the stream is gone
	}
	if resp.ID != int64(id) {
		return 0, fmt.Errorf("keepalive of lease %x answered for lease %x", id, resp.ID)
	}
	return resp.TTL, nil
}

// close ends the stream; a nil stream is closed already.
func (st *keepaliveStream) close() {
	if st != nil {
		st.cancel()
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
