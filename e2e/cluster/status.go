package cluster

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials"
)

const (
	// statusTimeout bounds one member's answer inside Leader and the
	// waits: a stopped member never answers.
	statusTimeout = time.Second
	// pollInterval is how often the waits ask again.
	pollInterval = 10 * time.Millisecond
)

// fastReconnect makes gRPC retry a refused connection within 100 ms
// instead of its default backoff, which grows to two minutes: members
// here come back in seconds, and the tests time how fast.
var fastReconnect = grpc.WithConnectParams(grpc.ConnectParams{
	Backoff:           backoff.Config{BaseDelay: 20 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 100 * time.Millisecond},
	MinConnectTimeout: time.Second,
})

// dialStatus opens a connection to one member for status requests. It is
// plain gRPC, not clientv3: no retries and no waiting for a ready
// connection, so a dead member answers "unavailable" at once.
func dialStatus(clientURL string, tc *tls.Config) (*grpc.ClientConn, error) {
	conn, err := grpc.NewClient("passthrough:///"+strings.TrimPrefix(clientURL, "https://"),
		grpc.WithTransportCredentials(credentials.NewTLS(tc)), fastReconnect)
	if err != nil {
		return nil, fmt.Errorf("dial %s: %w", clientURL, err)
	}
	return conn, nil
}

// Status asks member i alone for its status: its ID, the leader it
// follows, its raft term and index, and the revision it has applied.
func (c *Cluster) Status(ctx context.Context, i int) (*clientv3.StatusResponse, error) {
	m, err := c.member(i)
	if err != nil {
		return nil, err
	}
	conn, err := m.statusConn()
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, statusTimeout)
	defer cancel()
	resp, err := pb.NewMaintenanceClient(conn).Status(ctx, &pb.StatusRequest{})
	if err != nil {
		return nil, fmt.Errorf("status of %s: %w", m.name, err)
	}
	return (*clientv3.StatusResponse)(resp), nil
}

// statuses asks every member at once; a member that did not answer has a
// nil response and its error.
func (c *Cluster) statuses(ctx context.Context) ([]*clientv3.StatusResponse, []error) {
	resps := make([]*clientv3.StatusResponse, len(c.members))
	errs := make([]error, len(c.members))
	var wg sync.WaitGroup
	for i := range c.members {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resps[i], errs[i] = c.Status(ctx, i)
		}()
	}
	wg.Wait()
	return resps, errs
}

// Leader returns the index of the member that says it is the leader and
// that a quorum of members (itself included) follow. A killed leader is
// not one, even while the others still name it: it does not answer.
func (c *Cluster) Leader(ctx context.Context) (int, error) {
	resps, errs := c.statuses(ctx)
	return leaderOf(resps, errs)
}

// leaderOf finds the leader in one round of statuses.
func leaderOf(resps []*clientv3.StatusResponse, errs []error) (int, error) {
	votes := map[uint64]int{}
	for _, r := range resps {
		if r != nil && r.Leader != 0 {
			votes[r.Leader]++
		}
	}
	for i, r := range resps {
		if r != nil && r.Leader == r.Header.MemberId && votes[r.Leader] > len(resps)/2 {
			return i, nil
		}
	}
	// Say what each member saw. The errors are not wrapped: a member that
	// exited does not end a wait for the others to elect a leader.
	seen := make([]string, len(resps))
	for i, r := range resps {
		switch {
		case errs[i] != nil:
			seen[i] = errs[i].Error()
		case r.Leader == 0:
			seen[i] = fmt.Sprintf("%x follows no leader (term %d)", r.Header.MemberId, r.RaftTerm)
		default:
			seen[i] = fmt.Sprintf("%x follows %x (term %d)", r.Header.MemberId, r.Leader, r.RaftTerm)
		}
	}
	return -1, fmt.Errorf("%w: %s", ErrNoLeader, strings.Join(seen, "; "))
}

// WaitLeader asks for the leader every 10 ms until there is one or ctx
// ends.
func (c *Cluster) WaitLeader(ctx context.Context) (int, error) {
	leader := -1
	err := poll(ctx, func() (err error) {
		leader, err = c.Leader(ctx)
		return err
	})
	if err != nil {
		return -1, fmt.Errorf("wait for a leader: %w", err)
	}
	return leader, nil
}

// WaitHealthy waits until every member that has not been killed answers,
// reports no errors and follows the same leader, which says it leads. A
// stopped member never answers: WaitHealthy then waits until ctx ends. A
// member whose process ended by itself fails the wait at once.
func (c *Cluster) WaitHealthy(ctx context.Context) error {
	err := poll(ctx, func() error {
		resps, errs := c.statuses(ctx)
		leader, err := leaderOf(resps, errs)
		if err != nil {
			return err
		}
		lead := resps[leader].Header.MemberId
		for i, r := range resps {
			switch {
			case errors.Is(errs[i], ErrNotRunning):
			case errs[i] != nil:
				return errs[i]
			case len(r.Errors) > 0:
				return fmt.Errorf("%s: %s", c.members[i].name, strings.Join(r.Errors, "; "))
			case r.Leader != lead:
				return fmt.Errorf("%s follows %x, not %s", c.members[i].name, r.Leader, c.members[leader].name)
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("wait for a healthy cluster: %w", err)
	}
	return nil
}

// WaitRevision waits until member i has applied revision rev (a write's
// Header.Revision, say): it has caught up with that write.
func (c *Cluster) WaitRevision(ctx context.Context, i int, rev int64) error {
	err := poll(ctx, func() error {
		r, err := c.Status(ctx, i)
		if err != nil {
			return err
		}
		if r.Header.Revision < rev {
			return fmt.Errorf("at revision %d, not yet %d", r.Header.Revision, rev)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("wait for member %d at revision %d: %w", i, rev, err)
	}
	return nil
}

// poll calls try every pollInterval until it returns nil, it returns an
// error wrapping ErrExited (that will not change), or ctx ends; then the
// error says what the last try saw.
func poll(ctx context.Context, try func() error) error {
	tick := time.NewTicker(pollInterval)
	defer tick.Stop()
	for {
		err := try()
		if err == nil || errors.Is(err, ErrExited) {
			return err
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w; last: %w", ctx.Err(), err)
		case <-tick.C:
		}
	}
}

// CPUTime is the CPU time, user plus system, that the members' running
// processes have used since each started: the cluster's share of a
// benchmark's CPU, which its own process's counters leave out.
func (c *Cluster) CPUTime() (time.Duration, error) {
	var sum time.Duration
	for _, m := range c.members {
		d, err := m.cpu()
		if err != nil {
			return 0, fmt.Errorf("%s: %w", m.name, err)
		}
		sum += d
	}
	return sum, nil
}

// MaxRSS is the largest resident memory, in bytes, of the members'
// running processes: the memory an etcd member needs for what the
// cluster holds.
func (c *Cluster) MaxRSS() (int64, error) {
	var most int64
	for _, m := range c.members {
		n, err := m.rss()
		if err != nil {
			return 0, fmt.Errorf("%s: %w", m.name, err)
		}
		most = max(most, n)
	}
	return most, nil
}
