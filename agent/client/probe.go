package client

import (
	"context"
	"fmt"

	"github.com/kvipam/kvipam/agent/api"
)

// Probe is the agent's health as a container probe sees it, through the
// agent's socket: live, that the agent answers there, ready or not;
// otherwise also that it is ready to allocate. The error says which
// failed and why. `kvipam-agent health` (an exec probe) and the agent's
// own /livez and /readyz (HTTP probes) both answer with it.
func (c *Client) Probe(ctx context.Context, live bool) (*api.Status, error) {
	st, err := c.Status(ctx)
	if err != nil {
		return nil, fmt.Errorf("agent not answering on %s: %w", c.socket, err)
	}
	if !live && !st.Ready {
		return st, fmt.Errorf("node %s not ready: %s", st.Node, st.Message)
	}
	return st, nil
}
