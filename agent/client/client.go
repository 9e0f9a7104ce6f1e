// Package client calls the kvipam agent over its unix socket. A Client is
// safe for concurrent use.
package client

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"os"
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

// Client talks to one agent socket, over HTTP/1.1 (transport).
type Client struct {
	socket  string
	timeout time.Duration
	tr      *transport
}

// New returns a client for the agent at socket. timeout bounds each call.
func New(socket string, timeout time.Duration) *Client {
	if socket == "" {
		socket = DefaultSocket
	}
	return &Client{socket: socket, timeout: timeout, tr: &transport{socket: socket}}
}

// CloseIdleConnections closes the connections the client keeps open
// between calls; a later call dials again.
func (c *Client) CloseIdleConnections() { c.tr.closeIdle() }

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
			if err := c.do(ctx, "GET", api.PathHealth, nil, &out); err == nil || !errors.Is(err, ErrUnreachable) {
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
	if err := c.do(ctx, "GET", api.PathStatus, nil, &st); err != nil {
		return nil, err
	}
	return &st, nil
}

// Config returns what a plugin needs to set a pod up.
func (c *Client) Config(ctx context.Context) (*api.Config, error) {
	var out api.Config
	return &out, c.do(ctx, "GET", api.PathConfig, nil, &out)
}

// Allocate reserves (or, with Permanent, allocates) IPs for an owner.
func (c *Client) Allocate(ctx context.Context, req api.AllocateRequest) (*api.AllocateResponse, error) {
	var out api.AllocateResponse
	return &out, c.do(ctx, "POST", api.PathAllocate, req, &out)
}

// Release frees an owner's IPs and removes its endpoint; idempotent.
func (c *Client) Release(ctx context.Context, o api.Owner) (*api.ReleaseResponse, error) {
	return c.ReleaseAttachment(ctx, api.ReleaseRequest{Owner: o})
}

// ReleaseAttachment is Release with the attachment's host veth, which the
// agent retires first and deletes in the background (CNI DEL).
func (c *Client) ReleaseAttachment(ctx context.Context, req api.ReleaseRequest) (*api.ReleaseResponse, error) {
	var out api.ReleaseResponse
	return &out, c.do(ctx, "POST", api.PathRelease, req, &out)
}

// CreateEndpoint confirms the reservation and programs the datapath.
func (c *Client) CreateEndpoint(ctx context.Context, req api.EndpointRequest) (*api.Endpoint, error) {
	var out api.Endpoint
	return &out, c.do(ctx, "POST", api.PathEndpoints, req, &out)
}

// Endpoints lists the endpoints the agent has programmed.
func (c *Client) Endpoints(ctx context.Context) ([]api.Endpoint, error) {
	var out api.EndpointList
	err := c.do(ctx, "GET", api.PathEndpoints, nil, &out)
	return out.Endpoints, err
}

// EndpointStats lists the endpoints with their datapath counters.
func (c *Client) EndpointStats(ctx context.Context) ([]api.Endpoint, error) {
	var out api.EndpointList
	err := c.do(ctx, "GET", api.PathEndpoints+"?stats=1", nil, &out)
	return out.Endpoints, err
}

// Allocations lists the addresses one owner holds on this node.
func (c *Client) Allocations(ctx context.Context, o api.Owner) ([]api.Allocation, error) {
	q := url.Values{"containerID": {o.ContainerID}, "ifName": {o.IfName}}
	var out api.AllocationList
	err := c.do(ctx, "GET", api.PathAllocations+"?"+q.Encode(), nil, &out)
	return out.Allocations, err
}

// GC releases allocations of this node not in the valid list.
func (c *Client) GC(ctx context.Context, req api.GCRequest) (*api.GCResponse, error) {
	var out api.GCResponse
	return &out, c.do(ctx, "POST", api.PathGC, req, &out)
}

// do sends one call: in, when not nil, as the JSON body; the answer's
// JSON body into out. An answer of 300 or more is the agent's *api.Error
// (or one made up from an answer that is not one). The call is bounded
// by the client's timeout and ctx; the agent hears the bound
// (api.HeaderTimeout).
func (c *Client) do(ctx context.Context, method, path string, in, out any) error {
	var body []byte
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return fmt.Errorf("encode %s request: %w", path, err)
		}
		body = b
	}
	var deadline time.Time
	if c.timeout > 0 {
		deadline = time.Now().Add(c.timeout)
	}
	if d, ok := ctx.Deadline(); ok && (deadline.IsZero() || d.Before(deadline)) {
		deadline = d
	}
	var wait time.Duration
	if !deadline.IsZero() {
		if wait = time.Until(deadline); wait <= 0 {
			return fmt.Errorf("%s %s via %s: %w: %w", method, path, c.socket, ErrUnreachable, context.DeadlineExceeded)
		}
	}
	resp, err := c.tr.roundTrip(ctx, appendRequest(nil, method, path, body, wait), deadline)
	if errors.Is(err, ErrNoAgent) {
		return fmt.Errorf("%s %s via %s: %w", method, path, c.socket, err)
	}
	if err != nil {
		if isTimeout(err) && !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, context.Canceled) {
			// the connection's deadline, the call's bound, passed
			err = fmt.Errorf("no answer within %s: %w (%w)", wait.Round(time.Millisecond), context.DeadlineExceeded, err)
		}
		return fmt.Errorf("%s %s via %s: %w: %w", method, path, c.socket, ErrUnreachable, err)
	}
	if resp.status >= 300 {
		ae := &api.Error{Status: resp.status}
		if json.Unmarshal(resp.body, ae) != nil || ae.Code == "" {
			ae.Code, ae.Message = api.CodeInternal, fmt.Sprintf("agent answered %s: %s", resp.statusLine, bytes.TrimSpace(resp.body))
		}
		return ae
	}
	if out == nil || len(resp.body) == 0 {
		return nil
	}
	if err := json.Unmarshal(resp.body, out); err != nil {
		return fmt.Errorf("decode %s answer: %w", path, err)
	}
	return nil
}
