package cni

import (
	"context"
	"fmt"

	"github.com/kvipam/kvipam/agent/api"
)

// gcPool is GC for both plugins: release this network's allocations of
// the pool on this node whose attachment is not in the configuration's
// valid list. Without a list (a caller that sent none), it does nothing
// rather than release every attachment.
func gcPool(ctx context.Context, ag Agent, c *Config) (*api.GCResponse, error) {
	if c.ValidAttachments == nil {
		return &api.GCResponse{}, nil
	}
	pool, err := poolName(ctx, ag, c)
	if err != nil {
		return nil, err
	}
	valid := make([]api.Attachment, 0, len(c.ValidAttachments))
	for _, a := range c.ValidAttachments {
		if a.ContainerID != "" && a.IfName != "" { // an incomplete entry matches nothing
			valid = append(valid, a)
		}
	}
	res, err := ag.GC(ctx, api.GCRequest{ValidAttachments: valid, Pool: pool, Network: c.Name})
	if err != nil {
		return nil, fmt.Errorf("gc pool %s: %w", pool, err)
	}
	return res, nil
}
