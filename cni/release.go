package cni

import (
	"context"
	"errors"
	"fmt"

	"github.com/hashicorp/go-hclog"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/agent/client"
	"github.com/kvipam/kvipam/agent/delqueue"
)

// releaseOrQueue releases an owner's IPs. When the agent cannot be reached
// at all, the release goes to the DEL queue, which the agent drains when
// it starts, and that counts as done. When the agent answers but cannot
// release now (etcd down), the error stands, with code 11, so the runtime
// retries: an entry queued while the agent runs would wait for its next
// restart.
func releaseOrQueue(ag Agent, c *Config, o api.Owner, log hclog.Logger) (queued bool, err error) {
	ctx, cancel := context.WithTimeout(context.Background(), c.AgentTimeout)
	defer cancel()
	res, err := ag.Release(ctx, api.Owner{ContainerID: o.ContainerID, IfName: o.IfName})
	var ae *api.Error
	switch {
	case err == nil:
		log.Debug("released", "owner", o.Key(), "ips", res.Released)
		return false, nil
	case errors.As(err, &ae) && ae.Code == api.CodeNotFound:
		return false, nil
	case !errors.Is(err, client.ErrUnreachable):
		return false, fmt.Errorf("release %s: %w", o.Key(), err)
	}
	if qerr := delqueue.Enqueue(c.DelQueueDir, api.Owner{ContainerID: o.ContainerID, IfName: o.IfName}); qerr != nil {
		return false, fmt.Errorf("release %s: %w; and could not queue it: %w", o.Key(), err, qerr)
	}
	log.Warn("agent unreachable; release queued for the agent's next start", "owner", o.Key(), "queue", c.DelQueueDir, "error", err)
	return true, nil
}

// rollback undoes an ADD after its allocation: it removes the host veth
// (when one was made) and releases the owner. The CNI code stays that of
// cause; cleanup failures are joined to its message.
func rollback(ag Agent, c *Config, o api.Owner, hostIf string, log hclog.Logger, cause error) error {
	var errs []error
	if hostIf != "" {
		if _, err := DeleteHostVeth(hostIf); err != nil {
			errs = append(errs, fmt.Errorf("roll back: %w", err))
		}
	}
	if _, err := releaseOrQueue(ag, c, o, log); err != nil {
		errs = append(errs, fmt.Errorf("roll back: %w", err))
	}
	log.Info("add rolled back", "owner", o.Key(), "cause", cause, "cleanup_errors", len(errs))
	if len(errs) == 0 {
		return cause
	}
	return withCode(Code(cause), errors.Join(append([]error{cause}, errs...)...))
}
