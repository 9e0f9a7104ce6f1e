// Package client calls the kvipam agent over its unix socket. A Client is
// safe for concurrent use.
package client

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"syscall"
	"time"

	"github.com/kvipam/kvipam/agent/api"
)

// DefaultSocket is where the agent listens unless configured otherwise.
const DefaultSocket = "/run/kvipam/agent.sock"

// ErrUnreachable wraps failures to reach the agent at all (no socket, no
// answer). The CNI plugins turn it into CNI error 11, "try again later".
var ErrUnreachable = errors.New("kvipam agent unreachable")

// ErrNoAgent wraps a dial that found no agent at all: no socket file, or
// a stale one nobody listens on (connection refused). It is an
// ErrUnreachable too. Unlike a connection that breaks mid-call, waiting
// cannot be expected to help, so a plugin fails at once and lets the
// runtime retry.
var ErrNoAgent = fmt.Errorf("no kvipam agent listens there: %w", ErrUnreachable)

// Client talks to one agent socket.
type Client struct {
	socket string
	http   *http.Client
}

// New returns a client for the agent at socket. timeout bounds each call.
func New(socket string, timeout time.Duration) *Client {
	if socket == "" {
		socket = DefaultSocket
	}
	tr := &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			conn, err := d.DialContext(ctx, "unix", socket)
			if errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ECONNREFUSED) {
				return nil, fmt.Errorf("%w: %w", ErrNoAgent, err)
			}
			return conn, err
		},
		MaxIdleConns: 4,
	}
	return &Client{socket: socket, http: &http.Client{Transport: tr, Timeout: timeout}}
}

// Socket is the path this client dials.
func (c *Client) Socket() string { return c.socket }

// WaitReady polls for the socket until it answers a health check or ctx
// ends. A plugin calls it with a short deadline: an agent that is
// restarting comes back within seconds.
func (c *Client) WaitReady(ctx context.Context) error {
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		if _, err := os.Stat(c.socket); err == nil {
			var out map[string]any
			if err := c.do(ctx, http.MethodGet, api.PathHealth, nil, &out); err == nil || !errors.Is(err, ErrUnreachable) {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("wait for agent socket %s: %w: %w", c.socket, ErrUnreachable, ctx.Err())
		case <-tick.C:
		}
	}
}

// Status returns the agent's status; Ready says whether it can allocate.
func (c *Client) Status(ctx context.Context) (*api.Status, error) {
	var st api.Status
	if err := c.do(ctx, http.MethodGet, api.PathStatus, nil, &st); err != nil {
		return nil, err
	}
	return &st, nil
}

// Config returns what a plugin needs to set a pod up.
func (c *Client) Config(ctx context.Context) (*api.Config, error) {
	var out api.Config
	return &out, c.do(ctx, http.MethodGet, api.PathConfig, nil, &out)
}

// Allocate reserves (or, with Permanent, allocates) IPs for an owner.
func (c *Client) Allocate(ctx context.Context, req api.AllocateRequest) (*api.AllocateResponse, error) {
	var out api.AllocateResponse
	return &out, c.do(ctx, http.MethodPost, api.PathAllocate, req, &out)
}

// Release frees an owner's IPs and removes its endpoint; idempotent.
func (c *Client) Release(ctx context.Context, o api.Owner) (*api.ReleaseResponse, error) {
	return c.ReleaseAttachment(ctx, api.ReleaseRequest{Owner: o})
}

// ReleaseAttachment is Release with the attachment's host veth, which the
// agent retires first and deletes in the background (CNI DEL).
func (c *Client) ReleaseAttachment(ctx context.Context, req api.ReleaseRequest) (*api.ReleaseResponse, error) {
	var out api.ReleaseResponse
	return &out, c.do(ctx, http.MethodPost, api.PathRelease, req, &out)
}

// CreateEndpoint confirms the reservation and programs the datapath.
func (c *Client) CreateEndpoint(ctx context.Context, req api.EndpointRequest) (*api.Endpoint, error) {
	var out api.Endpoint
	return &out, c.do(ctx, http.MethodPost, api.PathEndpoints, req, &out)
}

// Endpoints lists the endpoints the agent has programmed.
func (c *Client) Endpoints(ctx context.Context) ([]api.Endpoint, error) {
	var out api.EndpointList
	err := c.do(ctx, http.MethodGet, api.PathEndpoints, nil, &out)
	return out.Endpoints, err
}

// EndpointStats lists the endpoints with their datapath counters.
func (c *Client) EndpointStats(ctx context.Context) ([]api.Endpoint, error) {
	var out api.EndpointList
	err := c.do(ctx, http.MethodGet, api.PathEndpoints+"?stats=1", nil, &out)
	return out.Endpoints, err
}

// Allocations lists the addresses one owner holds on this node.
func (c *Client) Allocations(ctx context.Context, o api.Owner) ([]api.Allocation, error) {
	q := url.Values{"containerID": {o.ContainerID}, "ifName": {o.IfName}}
	var out api.AllocationList
	err := c.do(ctx, http.MethodGet, api.PathAllocations+"?"+q.Encode(), nil, &out)
	return out.Allocations, err
}

// GC releases allocations of this node not in the valid list.
func (c *Client) GC(ctx context.Context, req api.GCRequest) (*api.GCResponse, error) {
	var out api.GCResponse
	return &out, c.do(ctx, http.MethodPost, api.PathGC, req, &out)
}

func (c *Client) do(ctx context.Context, method, path string, in, out any) error {
	var body io.Reader
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return fmt.Errorf("encode %s request: %w", path, err)
		}
		body = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, "http://kvipam"+path, body)
	if err != nil {
		return fmt.Errorf("build %s request: %w", path, err)
	}
	if in != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	wait := c.http.Timeout
	if d, ok := ctx.Deadline(); ok && (wait <= 0 || time.Until(d) < wait) {
		wait = time.Until(d)
	}
	if wait > 0 {
		req.Header.Set(api.HeaderTimeout, strconv.FormatInt(wait.Milliseconds(), 10))
	}
	resp, err := c.http.Do(req)
	if errors.Is(err, ErrNoAgent) {
		return fmt.Errorf("%s %s via %s: %w", method, path, c.socket, err)
	}
	if err != nil {
		return fmt.Errorf("%s %s via %s: %w: %w", method, path, c.socket, ErrUnreachable, err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return fmt.Errorf("read %s answer: %w: %w", path, ErrUnreachable, err)
	}
	if resp.StatusCode >= 300 {
		ae := &api.Error{Status: resp.StatusCode}
		if json.Unmarshal(data, ae) != nil || ae.Code == "" {
			ae.Code, ae.Message = api.CodeInternal, fmt.Sprintf("agent answered %s: %s", resp.Status, bytes.TrimSpace(data))
		}
		return ae
	}
	if out == nil || len(data) == 0 {
		return nil
	}
	if err := json.Unmarshal(data, out); err != nil {
		return fmt.Errorf("decode %s answer: %w", path, err)
	}
	return nil
}
