package cni

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/kvipam/kvipam/agent/client"
)

// checkStatus is STATUS for both plugins: nil when an ADD could succeed
// now, else code 50 (plugin not available) naming the reason: the agent
// is unreachable or not ready, another agent holds the node's name, etcd
// is unreachable, the node lost its lease, or the configured pool is
// exhausted on this node. CNI 1.1
// reserves 51 for "and existing containers may have limited
// connectivity", which none of these implies: running pods keep their
// routes while the agent or etcd is down.
func checkStatus(ctx context.Context, ag Agent, c *Config) error {
	st, err := ag.Status(ctx)
	if st == nil || errors.Is(err, client.ErrUnreachable) {
		return withCode(ErrCodeNotAvailable, fmt.Errorf("kvipam agent at %s is not available: %w", c.Socket, err))
	}
	switch {
	case st.NameTaken != nil:
		return withCode(ErrCodeNotAvailable, fmt.Errorf("kvipam agent on node %s serves no new pods: %s", st.Node, st.Message))
	case !st.Etcd.Reachable:
		return withCode(ErrCodeNotAvailable, fmt.Errorf("kvipam agent on node %s cannot reach etcd: %s", st.Node, st.Etcd.Error))
	case st.Lease.State != "" && st.Lease.State != "held":
		return withCode(ErrCodeNotAvailable, fmt.Errorf("kvipam agent on node %s lost its etcd lease; re-establishing", st.Node))
	case !st.Ready:
		return withCode(ErrCodeNotAvailable, fmt.Errorf("kvipam agent on node %s is not ready: %s", st.Node, st.Message))
	}
	pool, err := poolName(ctx, ag, c)
	if err != nil {
		return withCode(ErrCodeNotAvailable, err)
	}
	for _, ps := range st.Pools {
		if ps.Pool != pool || !ps.Exhausted || (len(c.Families) > 0 && !slices.Contains(c.Families, ps.Family)) {
			continue
		}
		return withCode(ErrCodeNotAvailable, fmt.Errorf("pool %s exhausted (%s) on node %s: %d of %d addresses in use and no free block to claim",
			ps.Pool, ps.Family, st.Node, ps.Used, ps.Capacity))
	}
	return nil
}

// poolName is the pool the configuration allocates from: its own, or the
// agent's default.
func poolName(ctx context.Context, ag Agent, c *Config) (string, error) {
	if c.Pool != "" {
		return c.Pool, nil
	}
	cfg, err := ag.Config(ctx)
	if err != nil {
		return "", fmt.Errorf("get agent config: %w", err)
	}
	return cfg.DefaultPool, nil
}
