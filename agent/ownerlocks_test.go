package agent

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/internal/testsupport/nstest"
)

// gatedDatapath holds Setup for one host interface until gate closes.
type gatedDatapath struct {
	Datapath
	hostIf  string
	entered chan struct{}
	gate    chan struct{}
}

func (g gatedDatapath) Setup(ctx context.Context, ep *api.Endpoint) error {
	if ep.HostIfName == g.hostIf {
		close(g.entered)
		<-g.gate
	}
	return g.Datapath.Setup(ctx, ep)
}

// TestOwnersRequestsOverlap: while one owner's endpoint create is held in
// the datapath, another owner's create and release complete, and a
// release of the held owner waits for its create.
func TestOwnersRequestsOverlap(t *testing.T) {
	cfg, h := hostNSConfig(t)
	ta := startAgent(t, cfg, Options{})
	ctx := context.Background()
	nstest.AddLink(t, h, "kvslow0")
	nstest.AddLink(t, h, "kvfast0")
	slow, fast := owner(1), owner(2)
	for _, o := range []api.Owner{slow, fast} {
		_, err := ta.c.Allocate(ctx, api.AllocateRequest{Owner: o})
		require.NoError(t, err)
	}
	g := gatedDatapath{hostIf: "kvslow0", entered: make(chan struct{}), gate: make(chan struct{})}
	m := ta.a.endpoints
	m.mu.Lock()
	g.Datapath = m.dp
	m.dp = g
	m.mu.Unlock()

	created := make(chan error, 1)
	go func() {
		_, err := ta.c.CreateEndpoint(ctx, api.EndpointRequest{Owner: slow, HostIfName: "kvslow0"})
		created <- err
	}()
	<-g.entered
	_, err := ta.c.CreateEndpoint(ctx, api.EndpointRequest{Owner: fast, HostIfName: "kvfast0"})
	require.NoError(t, err, "another owner's create waited for the held one")
	_, err = ta.c.Release(ctx, fast)
	require.NoError(t, err)

	released := make(chan error, 1)
	go func() {
		_, err := ta.c.Release(ctx, slow)
		released <- err
	}()
	select {
	case err := <-released:
		t.Fatalf("the held owner's release did not wait for its create: %v", err)
	case <-time.After(200 * time.Millisecond):
	}
	close(g.gate)
	require.NoError(t, <-created)
	require.NoError(t, <-released)
	require.Empty(t, ta.a.alloc.Lookup(slow), "the release ran before the create it waited for")
	eps, err := ta.c.Endpoints(ctx)
	require.NoError(t, err)
	require.Empty(t, eps)
}
