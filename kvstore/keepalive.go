package kvstore

import (
	"context"
	"sync"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// keeper sends the keepalives of every session of one client on one
// long-lived LeaseKeepAlive stream, as clientv3's lessor does, and knows
// when each was sent: etcd handles a stream's keepalives one at a time and
// answers them in order, so an answer is the answer to the oldest
// keepalive of its lease still unanswered on that stream.
//
// One stream a client, not one a session nor one a keepalive: a follower
// forwards each keepalive to the leader, as many at once as it has
// streams with one in flight, and the leader opens a peer connection (a
// TLS handshake) for each beyond those it has. With a stream a keepalive
// (clientv3's KeepAliveOnce) or a stream a session, 2,500 sessions in one
// process cost a three-member cluster its leader (docs/scale.md).
type keeper struct {
	cli  *clientv3.Client
	due  chan *Session // sessions whose keepalive is to be sent
	stop context.CancelFunc

	mu      sync.Mutex
	refs    int       // sessions using the keeper
	pending inflights // sent on the stream, not yet answered
	heard   time.Time // the stream opened or answered last then
	broken  chan uint64
}

// keepers holds the keeper of each client with a live session.
var keepers = struct {
	sync.Mutex
	m map[*clientv3.Client]*keeper
}{m: map[*clientv3.Client]*keeper{}}

// keeperOf returns cli's keeper, started if it is the first session's;
// each call is paired with a release.
func keeperOf(cli *clientv3.Client) *keeper {
	keepers.Lock()
	defer keepers.Unlock()
	k := keepers.m[cli]
	if k == nil {
		ctx, cancel := context.WithCancel(context.Background())
		k = &keeper{cli: cli, due: make(chan *Session), stop: cancel, broken: make(chan uint64, 1)}
		keepers.m[cli] = k
		go k.run(ctx)
	}
	k.refs++
	return k
}

// release ends the keeper with its last session.
func (k *keeper) release() {
	keepers.Lock()
	defer keepers.Unlock()
	if k.refs--; k.refs == 0 {
		delete(keepers.m, k.cli)
		k.stop()
	}
}

// send hands s's keepalive to the stream; false if ctx ended first.
func (k *keeper) send(ctx context.Context, s *Session) bool {
	select {
	case k.due <- s:
		return true
	case <-ctx.Done():
		return false
	}
}

// unanswered is how often the keeper looks for a silent stream: a
// keepalive left unanswered longer than its session's interval, and
// nothing heard for as long. It then ends the stream (a member that no
// longer answers) and the next keepalive opens another, perhaps to
// another member.
const unanswered = 250 * time.Millisecond

// run owns the stream: it opens it when a keepalive is due, sends, and
// ends it on an error or when it falls silent. A session's keepalive is
// not sent while its last one is still unanswered on the stream.
func (k *keeper) run(ctx context.Context) {
	var (
		st     *keepaliveStream
		gen    uint64 // the stream's generation
		ticker = time.NewTicker(unanswered)
	)
	defer ticker.Stop()
	end := func() {
		st.close()
		st = nil
		k.mu.Lock()
		k.pending.drop(gen)
		k.mu.Unlock()
	}
	defer func() { st.close() }()
	for {
		select {
		case <-ctx.Done():
			return
		case g := <-k.broken:
			if st != nil && g == gen {
				end()
			}
		case <-ticker.C:
			k.mu.Lock()
			silent := k.pending.silent(time.Now(), k.heard)
			k.mu.Unlock()
			if st != nil && silent {
				end()
			}
		case s := <-k.due:
			if st == nil {
				gen++
				var err error
				if st, err = openKeepalive(ctx, k.cli); err != nil {
					continue // the session's keepalive goes unanswered, and is sent again
				}
				k.mu.Lock()
				k.heard = time.Now()
				k.mu.Unlock()
				go k.recv(ctx, st, gen)
			}
			k.mu.Lock()
			queued := k.pending.has(gen, s)
			if !queued {
				k.pending.add(inflight{gen: gen, s: s, sent: time.Now()})
			}
			k.mu.Unlock()
			if queued {
				continue
			}
			if err := st.stream.Send(&pb.LeaseKeepAliveRequest{ID: int64(s.id)}); err != nil {
				end()
			}
		}
	}
}

// recv delivers the answers of the stream of generation gen until it ends.
func (k *keeper) recv(ctx context.Context, st *keepaliveStream, gen uint64) {
	for {
		resp, err := st.stream.Recv()
		if err != nil {
			select {
			case k.broken <- gen:
			case <-ctx.Done():
			}
			return
		}
		k.mu.Lock()
		f, ok := k.pending.answer(gen, clientv3.LeaseID(resp.ID))
		if ok {
			k.heard = time.Now()
		}
		k.mu.Unlock()
		switch {
		case !ok: // answer to a keepalive dropped with an older stream
		case resp.TTL <= 0:
			f.s.markDone() // etcd expired or revoked it
		default:
			f.s.extend(f.sent.Add(seconds(resp.TTL)))
		}
	}
}

// keepaliveStream is one LeaseKeepAlive stream, on whichever member the
// client's balancer picks. It requires a leader: a member cut off from
// its cluster ends the stream rather than holding keepalives it cannot
// forward.
type keepaliveStream struct {
	cancel context.CancelFunc
	stream pb.Lease_LeaseKeepAliveClient
}

// openKeepalive opens a stream; nil and the error if it cannot.
func openKeepalive(ctx context.Context, cli *clientv3.Client) (*keepaliveStream, error) {
	sctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	stream, err := pb.NewLeaseClient(cli.ActiveConnection()).LeaseKeepAlive(sctx)
	if err != nil {
		cancel()
		return nil, err
	}
	return &keepaliveStream{cancel: cancel, stream: stream}, nil
}

// close ends the stream; a nil stream is closed already.
func (st *keepaliveStream) close() {
	if st != nil {
		st.cancel()
	}
}
