package kvstore

import (
	"context"
	"errors"
	"fmt"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvipam/kvipam/internal/retry"
)

// ErrUnavailable marks an etcd request that failed because etcd did not
// answer in time: unreachable, no leader, a leader change, a request
// timeout, too many requests, the caller's deadline or the call timeout. It is retry.ErrUnavailable, so the
// allocator's callers test for it without knowing etcd or gRPC.
var ErrUnavailable = retry.ErrUnavailable

// Unavailable wraps err with ErrUnavailable if it is such a transport
// failure, keeping err in the chain; any other error (a refused compare,
// permission denied, a bad request) is returned as it is. It is the one
// place where gRPC codes are read.
func Unavailable(err error) error {
	if err == nil || errors.Is(err, ErrUnavailable) || !transient(err) {
		return err
	}
	return fmt.Errorf("%w (%w)", err, ErrUnavailable)
}

func transient(err error) bool {
	if errors.Is(err, context.DeadlineExceeded) {
		return true
	}
	var ee rpctypes.EtcdError
	if errors.As(err, &ee) {
		return transientCode(ee.Code())
	}
	for e := err; e != nil; e = errors.Unwrap(e) {
		if s, ok := status.FromError(e); ok && s.Code() != codes.OK && s.Code() != codes.Unknown {
			return transientCode(s.Code())
		}
	}
	return false
}

func transientCode(c codes.Code) bool {
	switch c {
	case codes.Unavailable, codes.DeadlineExceeded, codes.Aborted:
		return true
	case codes.ResourceExhausted: // "etcdserver: too many requests": applying lags behind
		return true
	}
	return false
}
