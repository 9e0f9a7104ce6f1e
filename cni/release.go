package cni

import (
	"context"
	"errors"
	"fmt"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/agent/client"
	"github.com/kvipam/kvipam/agent/delqueue"
)

// releaseOrQueue releases an owner's IPs, naming the pod's sticky
// identity (the kvipam.io/sticky and kvipam.io/ip-claim annotations of
// c, with o's namespace and pod) as its ADD did, so that the agent drops
// a binding naming the container even when it has no endpoint of it (an
// IPAM-only attachment, an ADD rolled back). With hostIf (DEL), the agent
// retires that veth before it releases (routes deleted, the datapath
// drops its traffic) and deletes it in the background; an agent that
// does not say it did (older than ReleaseRequest.HostIfName) leaves it
// here. When the agent cannot be reached at all, the veth is deleted
// here, the release goes to the DEL queue, which the agent drains when it
// is back, and that counts as done. When the agent answers but cannot
// release now (etcd down), the error stands, with code 11, so the runtime
// retries.
func releaseOrQueue(ag Agent, c *Config, o api.Owner, hostIf string, log logger) (queued bool, err error) {
	ctx, cancel := context.WithTimeout(context.Background(), c.AgentTimeout)
	defer cancel()
	owner := api.Owner{ContainerID: o.ContainerID, IfName: o.IfName}
	req := api.ReleaseRequest{Owner: owner, HostIfName: hostIf}
	if c.Sticky != 0 && o.Namespace != "" && (o.Pod != "" || c.IPClaim != "") {
		req.Owner.Namespace, req.Owner.Pod = o.Namespace, o.Pod
		req.Sticky, req.IPClaim = stickyText(c.Sticky), c.IPClaim
	}
	res, err := ag.ReleaseAttachment(ctx, req)
	// deleteVeth deletes the veth here, when the agent did not take it.
	deleteVeth := func() error {
		if hostIf == "" {
			return nil
		}
		_, err := DeleteHostVeth(hostIf)
		return err
	}
	var ae *api.Error
	switch {
	case err == nil:
		log.Debug("released", "owner", o.Key(), "ips", res.Released, "host_if", res.HostIf)
		if res.HostIf != "" {
			return false, nil // retired by the agent
		}
		return false, deleteVeth()
	case errors.As(err, &ae) && ae.Code == api.CodeNotFound:
		return false, deleteVeth()
	case !errors.Is(err, client.ErrUnreachable):
		return false, fmt.Errorf("release %s: %w", o.Key(), err)
	}
	// The veth goes first: once the IPs are released they may be handed
	// out again, and must not still be routed to this pod.
	if derr := deleteVeth(); derr != nil {
		return false, fmt.Errorf("release %s: %w; and %w", o.Key(), err, derr)
	}
	if qerr := delqueue.EnqueueRelease(c.DelQueueDir, req); qerr != nil {
		return false, fmt.Errorf("release %s: %w; and could not queue it: %w", o.Key(), err, qerr)
	}
	log.Warn("agent unreachable; release queued for the agent's next start", "owner", o.Key(), "queue", c.DelQueueDir, "error", err)
	return true, nil
}

// rollback undoes an ADD after its allocation: it removes the veth (when
// one was made: removeVeth is not nil) and releases the owner. The CNI
// code stays that of cause; cleanup failures are joined to its message.
func rollback(ag Agent, c *Config, o api.Owner, removeVeth func() error, log logger, cause error) error {
	var errs []error
	if removeVeth != nil {
		if err := removeVeth(); err != nil {
			errs = append(errs, fmt.Errorf("roll back: %w", err))
		}
	}
	if _, err := releaseOrQueue(ag, c, o, "", log); err != nil {
		errs = append(errs, fmt.Errorf("roll back: %w", err))
	}
	log.Info("add rolled back", "owner", o.Key(), "cause", cause, "cleanup_errors", len(errs))
	if len(errs) == 0 {
		return cause
	}
	return withCode(Code(cause), errors.Join(append([]error{cause}, errs...)...))
}
