package agent

import (
	"context"
	"net"
	"net/http"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/agent/client"
)

// TestRequestBudgetFollowsCaller: a request works as long as its caller
// waits (the plugin's agentTimeout, sent by the client), less a margin for
// the answer, not the agent's shorter request timeout; a caller that does
// not say gets the agent's.
func TestRequestBudgetFollowsCaller(t *testing.T) {
	s := &apiServer{timeout: time.Second, log: hclog.NewNullLogger(),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "t"}, []string{"path", "code"})}
	var mu sync.Mutex
	var left time.Duration
	mux := http.NewServeMux()
	mux.HandleFunc(api.PathStatus, route(s, needNothing, http.StatusOK, noInput, nil, func(ctx context.Context, _ struct{}) (api.Status, error) {
		d, _ := ctx.Deadline()
		mu.Lock()
		left = time.Until(d)
		mu.Unlock()
		return api.Status{}, nil
	}))
	sock := filepath.Join(t.TempDir(), "a.sock")
	ln, err := net.Listen("unix", sock)
	require.NoError(t, err)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: time.Minute}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	got := func() time.Duration { mu.Lock(); defer mu.Unlock(); return left }

	_, err = client.New(sock, 10*time.Second).Status(context.Background())
	require.NoError(t, err)
	require.Greater(t, got(), 5*time.Second, "the plugin waits 10 s: the request may work well past the agent's 1 s")
	require.LessOrEqual(t, got(), 9*time.Second, "less the margin for the answer")

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	_, err = client.New(sock, 10*time.Second).Status(ctx)
	require.NoError(t, err)
	require.Greater(t, got(), 1500*time.Millisecond, "a shorter context deadline is what the caller waits")
	require.LessOrEqual(t, got(), 3*time.Second)

	hc := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", sock)
	}}}
	resp, err := hc.Get("http://kvipam" + api.PathStatus)
	require.NoError(t, err)
	resp.Body.Close()
	require.LessOrEqual(t, got(), time.Second, "no header: the agent's request timeout")

	for _, h := range []string{"", "x", "-5", "0"} {
		r, err := http.NewRequest(http.MethodGet, "http://kvipam/", nil)
		require.NoError(t, err)
		r.Header.Set(api.HeaderTimeout, h)
		require.Equal(t, time.Second, s.budget(r), "header %q", h)
	}
	r, err := http.NewRequest(http.MethodGet, "http://kvipam/", nil)
	require.NoError(t, err)
	r.Header.Set(api.HeaderTimeout, "86400000")
	require.Equal(t, maxRequestBudget-time.Second, s.budget(r), "a day is bounded")
}

// TestGroupCommitRunsToCallersDeadline: a batch may work until its most
// patient caller's deadline, and at least the group commit's timeout.
func TestGroupCommitRunsToCallersDeadline(t *testing.T) {
	var left time.Duration
	g := newGroupCommit(batchFunc[int, int](func(ctx context.Context, reqs []int) []int {
		d, _ := ctx.Deadline()
		left = time.Until(d)
		return reqs
	}), 8, 0, 100*time.Millisecond)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan struct{})
	go func() { g.run(ctx); close(done) }()
	defer func() { cancel(); <-done }()

	rctx, rcancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer rcancel()
	_, err := g.do(rctx, 1)
	require.NoError(t, err)
	require.Greater(t, left, 5*time.Second, "the caller waits 10 s")

	_, err = g.do(context.Background(), 2)
	require.NoError(t, err)
	require.LessOrEqual(t, left, 100*time.Millisecond, "a caller without a deadline: the group commit's timeout")
}
