package cni

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/agent/client"
)

// Agent is the part of the node agent's API the plugins use. The real one
// is *client.Client; tests substitute fakes.
type Agent interface {
	WaitReady(ctx context.Context) error
	Config(ctx context.Context) (*api.Config, error)
	Allocate(ctx context.Context, req api.AllocateRequest) (*api.AllocateResponse, error)
	CreateEndpoint(ctx context.Context, req api.EndpointRequest) (*api.Endpoint, error)
	ReleaseAttachment(ctx context.Context, req api.ReleaseRequest) (*api.ReleaseResponse, error)
	Endpoints(ctx context.Context) ([]api.Endpoint, error)
	Status(ctx context.Context) (*api.Status, error)
	GC(ctx context.Context, req api.GCRequest) (*api.GCResponse, error)
	Allocations(ctx context.Context, o api.Owner) ([]api.Allocation, error)
}

var _ Agent = (*client.Client)(nil)

// NewAgentClient returns the client for the agent at socket; timeout
// bounds each call.
func NewAgentClient(socket string, timeout time.Duration) Agent { return client.New(socket, timeout) }

// allocate is ADD's first call to the agent, for both plugins: it asks
// for o's addresses as c says (permanent at once for kvipam-ipam, where
// no endpoint follows to confirm a reservation). It waits for a
// restarting agent (see retryUnreachable), which is safe because
// the agent gives a retried allocate of the same owner the same
// addresses.
func allocate(ctx context.Context, ag Agent, c *Config, o api.Owner, permanent bool) (*api.AllocateResponse, error) {
	req := api.AllocateRequest{
		Owner: o, PodPool: c.PodPool, Sticky: stickyText(c.Sticky), IPClaim: c.IPClaim, Migration: c.Migration,
		Pool: c.Pool, Families: c.Families, IPs: c.IPs, Permanent: permanent,
	}
	var alloc *api.AllocateResponse
	err := retryUnreachable(ctx, ag, c, func() (err error) {
		alloc, err = ag.Allocate(ctx, req)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("allocate for %s: %w", req.Owner.Key(), err)
	}
	return alloc, nil
}

// retryUnreachable runs call; when the connection to the agent broke
// (it went away mid-call: restarting), it waits up to agentTimeout for
// the socket to answer and runs call once more, else gives up with code
// 11. When no agent listens at all (no socket file, or connection
// refused) it fails at once with code 11, naming the socket: a
// misconfigured agentSocket or an agent that is not running would
// otherwise hold every ADD for the whole agentTimeout, and the runtime
// retries an ADD that fails with 11 anyway. Calling first and waiting
// only on failure saves a round trip on every ADD. call must be safe to
// repeat: the agent's calls for one owner are idempotent.
func retryUnreachable(ctx context.Context, ag Agent, c *Config, call func() error) error {
	err := call()
	if errors.Is(err, client.ErrNoAgent) {
		return withCode(types.ErrTryAgainLater, fmt.Errorf("%w (is kvipam-agent running on this node, and is agentSocket its socket?)", err))
	}
	if !errors.Is(err, client.ErrUnreachable) {
		return err
	}
	wctx, cancel := context.WithTimeout(ctx, c.AgentTimeout)
	defer cancel()
	if werr := ag.WaitReady(wctx); werr != nil {
		return withCode(types.ErrTryAgainLater, fmt.Errorf("kvipam agent not ready after %s: %w", c.AgentTimeout, werr))
	}
	return call()
}
