package kvstore

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvipam/kvipam/internal/foundation/retry"
)

// Unavailable wraps err with retry.ErrUnavailable if etcd did not answer
// in time (unreachable, no leader, a leader change, a request timeout,
// too many requests, the caller's deadline or the call timeout), keeping
// err in the chain, so the allocator's callers test for it without
// knowing etcd or gRPC. If etcd refused the request before proposing it
// ("too many requests": its applied index too far behind its committed
// one; or a proposal its raft node dropped: no leader), err wraps
// retry.ErrRefused too: nothing of it was applied, and etcd's client
// retries a write only when it was never sent, so no earlier attempt of
// the same call applied either. Any other error (a refused compare,
// permission denied, a bad request) is returned as it is. It is the one
// place where gRPC codes are read.
func Unavailable(err error) error {
	if err == nil || errors.Is(err, retry.ErrUnavailable) {
		return err
	}
	switch transient, refused := classify(err); {
	case refused:
		return fmt.Errorf("%w (%w: %w)", err, retry.ErrUnavailable, retry.ErrRefused)
	case transient:
		return fmt.Errorf("%w (%w)", err, retry.ErrUnavailable)
	}
	return err
}

// errProposalDropped is raft's refusal of a write sent to a member that
// knows no leader (a follower mid-election, a candidate). etcd passes it on
// as codes.Unknown with this message, so only the message tells it apart.
const errProposalDropped = "raft proposal dropped"

// classify says whether err is a try-again failure (transient) and, if
// so, whether etcd refused the request before proposing it (refused:
// retry.ErrRefused, "too many requests" or a dropped proposal).
func classify(err error) (transient, refused bool) {
	switch {
	// etcd's back-pressure: too many proposals in flight.
	case errors.Is(err, rpctypes.ErrTooManyRequests):
		return true, true
	case errors.Is(err, context.DeadlineExceeded),
		// A lease request that reached a member that has just lost its
		// leadership; the next one finds the new leader.
		errors.Is(err, rpctypes.ErrNotLeader):
		return true, false
	}
	var ee rpctypes.EtcdError
	if errors.As(err, &ee) {
		return transientCode(ee.Code()), false
	}
	for e := err; e != nil; e = errors.Unwrap(e) {
		s, ok := status.FromError(e)
		if !ok || s.Code() == codes.OK {
			continue
		}
		// Codes etcd shares between try-again and lasting errors.
		switch s.Code() {
		case codes.Unknown:
			dropped := strings.Contains(s.Message(), errProposalDropped)
			return dropped, dropped
		case codes.ResourceExhausted:
			busy := strings.Contains(s.Message(), rpctypes.ErrTooManyRequests.Error())
			return busy, busy
		case codes.FailedPrecondition:
			return strings.Contains(s.Message(), rpctypes.ErrNotLeader.Error()), false
		}
		return transientCode(s.Code()), false
	}
	return false, false
}

func transientCode(c codes.Code) bool {
	switch c {
	case codes.Unavailable, codes.DeadlineExceeded, codes.Aborted:
		return true
	}
	return false
}
