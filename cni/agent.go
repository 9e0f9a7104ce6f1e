package cni

import (
	"context"
	"time"

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
	Release(ctx context.Context, o api.Owner) (*api.ReleaseResponse, error)
	Endpoints(ctx context.Context) ([]api.Endpoint, error)
	Status(ctx context.Context) (*api.Status, error)
	GC(ctx context.Context, req api.GCRequest) (*api.GCResponse, error)
	Allocations(ctx context.Context, o api.Owner) ([]api.Allocation, error)
}

var _ Agent = (*client.Client)(nil)

// NewAgentClient returns the client for the agent at socket; timeout
// bounds each call.
func NewAgentClient(socket string, timeout time.Duration) Agent { return client.New(socket, timeout) }
