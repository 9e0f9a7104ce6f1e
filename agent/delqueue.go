package agent

import (
	"context"

	"github.com/hashicorp/go-hclog"

	"github.com/kvipam/kvipam/agent/api"
)

// drainQueue hands every queued DEL in dir to release.
func drainQueue(ctx context.Context, dir string, release func(context.Context, api.Owner) error, log hclog.Logger) error {
	return nil
}
