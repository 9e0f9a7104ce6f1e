package kvstore_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvipam/kvipam/internal/foundation/retry"
	"github.com/kvipam/kvipam/kvstore"
)

func TestUnavailableClassifies(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{rpctypes.ErrTimeout, true},
		{rpctypes.ErrTimeoutDueToLeaderFail, true},
		{rpctypes.ErrTimeoutDueToConnectionLost, true},
		{rpctypes.ErrNoLeader, true},
		{rpctypes.ErrLeaderChanged, true},
		{rpctypes.ErrGRPCTimeout, true},
		{rpctypes.ErrGRPCTimeoutDueToLeaderFail, true},
		{rpctypes.ErrGRPCLeaderChanged, true},
		{rpctypes.ErrGRPCNoLeader, true},
		{rpctypes.ErrTooManyRequests, true},
		{rpctypes.ErrGRPCRequestTooManyRequests, true},
		{rpctypes.ErrNotLeader, true},
		{rpctypes.ErrGRPCNotLeader, true},
		{rpctypes.ErrGRPCNoSpace, false},
		{rpctypes.ErrGRPCMemberNotEnoughStarted, false},
		{rpctypes.ErrTimeoutWaitAppliedIndex, true},
		{rpctypes.ErrUnhealthy, true},
		{rpctypes.ErrStopped, true},
		// What a follower mid-election answers a write (codes.Unknown).
		{status.Error(codes.Unknown, "raft proposal dropped"), true},
		{status.Error(codes.Unknown, "something else"), false},
		{rpctypes.ErrNoSpace, false},
		{rpctypes.ErrRequestTooLarge, false},
		{rpctypes.ErrCompacted, false},
		{status.Error(codes.Unavailable, "connection refused"), true},
		{status.Error(codes.DeadlineExceeded, "context deadline exceeded"), true},
		{fmt.Errorf("get /x: %w", context.DeadlineExceeded), true},
		{rpctypes.ErrPermissionDenied, false},
		{rpctypes.ErrLeaseNotFound, false},
		{rpctypes.ErrAuthFailed, false},
		{retry.ErrConflict, false},
		{context.Canceled, false},
		{errors.New("boom"), false},
	} {
		t.Run(tc.err.Error(), func(t *testing.T) {
			err := kvstore.Unavailable(fmt.Errorf("op: %w", tc.err))
			require.Equal(t, tc.want, errors.Is(err, retry.ErrUnavailable))
			require.ErrorIs(t, err, tc.err, "the original error stays in the chain")
		})
	}
	require.NoError(t, kvstore.Unavailable(nil))
}

// TestUnavailableTellsRefused: of the errors that say "try again", those
// etcd gives a request it refused before proposing it also wrap
// retry.ErrRefused (nothing applied); a timeout, whose write may have landed,
// does not.
func TestUnavailableTellsRefused(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{rpctypes.ErrTooManyRequests, true},
		{rpctypes.ErrGRPCRequestTooManyRequests, true},
		{status.Error(codes.Unknown, "raft proposal dropped"), true},
		{rpctypes.ErrTimeout, false},
		{rpctypes.ErrGRPCTimeout, false},
		{rpctypes.ErrNoLeader, false},
		{rpctypes.ErrNotLeader, false},
		{status.Error(codes.Unavailable, "connection refused"), false},
		{fmt.Errorf("txn: %w", context.DeadlineExceeded), false},
	} {
		t.Run(tc.err.Error(), func(t *testing.T) {
			err := kvstore.Unavailable(fmt.Errorf("op: %w", tc.err))
			require.ErrorIs(t, err, retry.ErrUnavailable)
			require.Equal(t, tc.want, errors.Is(err, retry.ErrRefused))
			require.ErrorIs(t, err, tc.err, "the original error stays in the chain")
		})
	}
}
