package client

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/agent/api"
)

// agentServer serves h on a unix socket with net/http's server, as the
// agent does, and counts the connections it accepts.
type agentServer struct {
	socket string
	srv    *http.Server
	conns  atomic.Int64
}

func serve(t *testing.T, h http.Handler) *agentServer {
	t.Helper()
	s := &agentServer{socket: filepath.Join(t.TempDir(), "agent.sock")}
	ln, err := net.Listen("unix", s.socket)
	require.NoError(t, err)
	s.srv = &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second, ConnState: func(_ net.Conn, st http.ConnState) {
		if st == http.StateNew {
			s.conns.Add(1)
		}
	}}
	go func() { _ = s.srv.Serve(ln) }()
	t.Cleanup(func() { _ = s.srv.Close() })
	return s
}

// writeJSON answers as the agent's apiServer.writeJSON does: status, then
// the encoded body, with no Content-Length (net/http chunks an answer over
// 2 KB).
func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func TestClientCalls(t *testing.T) {
	var many api.EndpointList
	for i := range 200 { // well over 2 KB: chunked
		many.Endpoints = append(many.Endpoints, api.Endpoint{ID: uint32(i), HostIfName: fmt.Sprintf("kv%011d", i)})
	}
	var lastReq atomic.Pointer[http.Request]
	var lastBody atomic.Pointer[[]byte]
	mux := http.NewServeMux()
	mux.HandleFunc("GET "+api.PathStatus, func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, 200, api.Status{Node: "n1", Ready: true})
	})
	mux.HandleFunc("GET "+api.PathEndpoints, func(w http.ResponseWriter, r *http.Request) {
		require.Equal(t, "1", r.URL.Query().Get("stats"))
		writeJSON(w, 200, many)
	})
	mux.HandleFunc("GET "+api.PathAllocations, func(w http.ResponseWriter, r *http.Request) {
		lastReq.Store(r)
		writeJSON(w, 200, api.AllocationList{})
	})
	mux.HandleFunc("POST "+api.PathAllocate, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		lastReq.Store(r)
		lastBody.Store(&b)
		writeJSON(w, 200, api.AllocateResponse{Pool: "default", State: "reserved"})
	})
	mux.HandleFunc("POST "+api.PathRelease, func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, 503, api.Error{Code: api.CodeTryAgain, Message: "etcd unreachable"})
	})
	s := serve(t, mux)
	c := New(s.socket, 5*time.Second)
	ctx := context.Background()

	st, err := c.Status(ctx)
	require.NoError(t, err)
	require.Equal(t, "n1", st.Node)
	require.True(t, st.Ready)

	eps, err := c.EndpointStats(ctx)
	require.NoError(t, err)
	require.Equal(t, many.Endpoints, eps)

	_, err = c.Allocations(ctx, api.Owner{ContainerID: "c 1&x", IfName: "eth0"})
	require.NoError(t, err)
	r := lastReq.Load()
	require.Equal(t, "c 1&x", r.URL.Query().Get("containerID"))
	require.Equal(t, "eth0", r.URL.Query().Get("ifName"))

	alloc, err := c.Allocate(ctx, api.AllocateRequest{Owner: api.Owner{ContainerID: "c1", IfName: "eth0"}, Pool: "default"})
	require.NoError(t, err)
	require.Equal(t, "reserved", alloc.State)
	r = lastReq.Load()
	require.Equal(t, "application/json", r.Header.Get("Content-Type"))
	var got api.AllocateRequest
	require.NoError(t, json.Unmarshal(*lastBody.Load(), &got))
	require.Equal(t, "c1", got.Owner.ContainerID)
	ms := r.Header.Get(api.HeaderTimeout)
	require.NotEmpty(t, ms, "the agent hears the call's bound")
	require.Regexp(t, `^[1-5]\d{3}$`, ms)

	_, err = c.Release(ctx, api.Owner{ContainerID: "c1", IfName: "eth0"})
	var ae *api.Error
	require.ErrorAs(t, err, &ae)
	require.Equal(t, api.CodeTryAgain, ae.Code)
	require.Equal(t, 503, ae.Status)
	require.Equal(t, "etcd unreachable", ae.Message)
	require.NotErrorIs(t, err, ErrUnreachable)

	_, err = c.GC(ctx, api.GCRequest{}) // no route: net/http's own 404 page
	require.ErrorAs(t, err, &ae)
	require.Equal(t, api.CodeInternal, ae.Code)
	require.Equal(t, 404, ae.Status)
	require.Equal(t, "agent answered 404 Not Found: 404 page not found", ae.Message)

	require.EqualValues(t, 1, s.conns.Load(), "every call on one kept-open connection")
}

// TestClientConcurrent: calls from many goroutines at once each get their
// own answer.
func TestClientConcurrent(t *testing.T) {
	mux := http.NewServeMux()
	mux.HandleFunc("GET "+api.PathAllocations, func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, 200, api.AllocationList{Allocations: []api.Allocation{{Pool: r.URL.Query().Get("containerID")}}})
	})
	c := New(serve(t, mux).socket, 5*time.Second)
	errs := make(chan error, 16)
	for i := range 16 {
		go func() {
			for j := range 20 {
				id := fmt.Sprintf("c%d-%d", i, j)
				as, err := c.Allocations(context.Background(), api.Owner{ContainerID: id})
				if err == nil && (len(as) != 1 || as[0].Pool != id) {
					err = fmt.Errorf("asked for %s, got %+v", id, as)
				}
				if err != nil {
					errs <- err
					return
				}
			}
			errs <- nil
		}()
	}
	for range 16 {
		require.NoError(t, <-errs)
	}
}

// TestClientNoAgent: no socket file, or a stale one nobody listens on, is
// ErrNoAgent (and so ErrUnreachable), naming the socket.
func TestClientNoAgent(t *testing.T) {
	dir := t.TempDir()
	stale := filepath.Join(dir, "stale.sock")
	ln, err := net.Listen("unix", stale)
	require.NoError(t, err)
	ln.(*net.UnixListener).SetUnlinkOnClose(false)
	require.NoError(t, ln.Close())
	for _, sock := range []string{filepath.Join(dir, "missing.sock"), stale} {
		_, err := New(sock, time.Second).Status(context.Background())
		require.ErrorIs(t, err, ErrNoAgent)
		require.ErrorIs(t, err, ErrUnreachable)
		require.Contains(t, err.Error(), sock)
	}
}

// TestClientBrokenMidCall: a connection that breaks before the answer is
// ErrUnreachable, not ErrNoAgent; so is one whose answer is cut short or
// is not HTTP.
func TestClientBrokenMidCall(t *testing.T) {
	for name, answer := range map[string]string{
		"closed":   "",
		"cut":      "HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"node\":",
		"not HTTP": "garbage\r\n\r\n",
	} {
		t.Run(name, func(t *testing.T) {
			sock := filepath.Join(t.TempDir(), "a.sock")
			ln, err := net.Listen("unix", sock)
			require.NoError(t, err)
			defer ln.Close()
			go func() {
				for {
					c, err := ln.Accept()
					if err != nil {
						return
					}
					buf := make([]byte, 4096)
					_, _ = c.Read(buf)
					_, _ = io.WriteString(c, answer)
					_ = c.Close()
				}
			}()
			_, err = New(sock, 5*time.Second).Status(context.Background())
			require.ErrorIs(t, err, ErrUnreachable)
			require.NotErrorIs(t, err, ErrNoAgent)
			require.Contains(t, err.Error(), "GET /v1/status via "+sock)
		})
	}
}

// TestClientTimeout: the client's timeout, and ctx's end, bound a call
// the agent does not answer; both are ErrUnreachable.
func TestClientTimeout(t *testing.T) {
	release := make(chan struct{})
	defer close(release)
	mux := http.NewServeMux()
	mux.HandleFunc("GET "+api.PathStatus, func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-release:
		case <-r.Context().Done():
		}
	})
	s := serve(t, mux)

	start := time.Now()
	_, err := New(s.socket, 200*time.Millisecond).Status(context.Background())
	require.ErrorIs(t, err, ErrUnreachable)
	require.Contains(t, err.Error(), "no answer within 200ms")
	require.Less(t, time.Since(start), 3*time.Second)

	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(100*time.Millisecond, cancel)
	_, err = New(s.socket, time.Minute).Status(ctx)
	require.ErrorIs(t, err, ErrUnreachable)
	require.ErrorIs(t, err, context.Canceled)

	ctx, cancel = context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	_, err = New(s.socket, time.Minute).Status(ctx)
	require.ErrorIs(t, err, ErrUnreachable)
	require.ErrorIs(t, err, context.DeadlineExceeded)
}

// TestClientAgentRestarts: a kept-open connection the agent closed (it
// restarted) is dropped for a new one, and the call succeeds; with the
// agent gone, the call is ErrNoAgent.
func TestClientAgentRestarts(t *testing.T) {
	mux := http.NewServeMux()
	mux.HandleFunc("GET "+api.PathStatus, func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, 200, api.Status{Node: "n1"})
	})
	s := serve(t, mux)
	c := New(s.socket, 5*time.Second)
	_, err := c.Status(context.Background())
	require.NoError(t, err)

	require.NoError(t, s.srv.Close()) // closes the kept-open connection
	_, err = c.Status(context.Background())
	require.ErrorIs(t, err, ErrNoAgent, "%v", err)

	s2 := serve(t, mux)
	c = New(s2.socket, 5*time.Second)
	_, err = c.Status(context.Background())
	require.NoError(t, err)
	s2.srv.SetKeepAlivesEnabled(false) // closes idle connections; answers close
	for range 3 {
		_, err = c.Status(context.Background())
		require.NoError(t, err)
	}
	require.EqualValues(t, 4, s2.conns.Load())
}

// TestClientAgentDiesMidCallOnAKeptConnection: the agent reads the second
// call's request on the kept-open connection and goes away without an
// answer (its socket with it). That is a connection broken mid-call,
// ErrUnreachable, which a plugin waits out; not ErrNoAgent, which it
// does not.
func TestClientAgentDiesMidCallOnAKeptConnection(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "a.sock")
	ln, err := net.Listen("unix", sock)
	require.NoError(t, err)
	defer ln.Close()
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		buf := make([]byte, 4096)
		_, _ = c.Read(buf)
		_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 13\r\n\r\n{\"node\":\"n1\"}")
		_, _ = c.Read(buf) // the second request
		_ = ln.Close()     // the agent is gone: its socket file too
		_ = c.Close()
	}()
	c := New(sock, 5*time.Second)
	st, err := c.Status(context.Background())
	require.NoError(t, err)
	require.Equal(t, "n1", st.Node)
	_, err = c.Allocate(context.Background(), api.AllocateRequest{})
	require.ErrorIs(t, err, ErrUnreachable)
	require.NotErrorIs(t, err, ErrNoAgent)
	require.Contains(t, err.Error(), "read answer")
}

func TestWaitReady(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "late.sock")
	c := New(sock, time.Second)
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	err := c.WaitReady(ctx)
	require.ErrorIs(t, err, ErrUnreachable)
	require.ErrorIs(t, err, context.DeadlineExceeded)

	mux := http.NewServeMux()
	mux.HandleFunc("GET "+api.PathHealth, func(w http.ResponseWriter, r *http.Request) { writeJSON(w, 200, map[string]any{"ok": true}) })
	go func() {
		time.Sleep(200 * time.Millisecond)
		ln, err := net.Listen("unix", sock)
		if err != nil {
			return
		}
		srv := &http.Server{Handler: mux, ReadHeaderTimeout: time.Second}
		t.Cleanup(func() { _ = srv.Close() })
		_ = srv.Serve(ln)
	}()
	ctx, cancel = context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	require.NoError(t, c.WaitReady(ctx))
	require.False(t, errors.Is(ctx.Err(), context.DeadlineExceeded))
}
