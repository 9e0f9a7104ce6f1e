package retry_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/internal/foundation/retry"
)

func TestRetry(t *testing.T) {
	ctx := context.Background()
	var n int
	err := retry.Do(ctx, retry.Policy{}, func(context.Context) error {
		n++
		if n < 3 {
			return fmt.Errorf("claim: %w", retry.ErrConflict)
		}
		return nil
	})
	require.NoError(t, err)
	require.Equal(t, 3, n)

	n = 0
	boom := errors.New("boom")
	err = retry.Do(ctx, retry.Policy{}, func(context.Context) error { n++; return boom })
	require.ErrorIs(t, err, boom)
	require.Equal(t, 1, n, "only conflicts are retried")

	n = 0
	err = retry.Do(ctx, retry.Policy{Attempts: 4, Initial: time.Millisecond, Max: time.Millisecond, Multiplier: 1}, func(context.Context) error {
		n++
		return retry.ErrConflict
	})
	require.ErrorIs(t, err, retry.ErrConflict)
	require.Equal(t, 4, n, "attempts are bounded")
}

func TestRetryUnlimitedEndsWithContext(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	var n int
	err := retry.Do(ctx, retry.Policy{Attempts: retry.Unlimited, Initial: time.Microsecond, Max: time.Microsecond, Multiplier: 1}, func(context.Context) error {
		n++
		if n == 500 {
			cancel()
		}
		return retry.ErrConflict
	})
	require.ErrorIs(t, err, retry.ErrConflict)
	require.ErrorIs(t, err, context.Canceled, "only the context ends an unlimited loop")
	require.GreaterOrEqual(t, n, 500, "well past the default budget")
}

func TestRetryUnavailableInsideDeadline(t *testing.T) {
	busy := fmt.Errorf("etcdserver: too many requests: %w", retry.ErrUnavailable)
	var n int
	op := func(context.Context) error {
		n++
		if n < 4 {
			return busy
		}
		return nil
	}
	err := retry.Do(context.Background(), retry.Policy{Unavailable: true}, op)
	require.ErrorIs(t, err, retry.ErrUnavailable, "no deadline: answered at once")
	require.Equal(t, 1, n)

	n = 0
	err = retry.Do(context.Background(), retry.Policy{}, op)
	require.ErrorIs(t, err, retry.ErrUnavailable, "not retried unless the policy says so")
	require.Equal(t, 1, n)

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	n = 0
	err = retry.Do(ctx, retry.Policy{Attempts: 1, Unavailable: true}, op)
	require.NoError(t, err, "retried inside the deadline")
	require.Equal(t, 4, n, "not counted against the attempts")

	short, cancel := context.WithTimeout(context.Background(), retry.UnavailablePace.Initial/4)
	defer cancel()
	n = 0
	err = retry.Do(short, retry.Policy{Unavailable: true}, func(context.Context) error { n++; return busy })
	require.ErrorIs(t, err, retry.ErrUnavailable)
	require.Equal(t, 1, n, "no room left before the deadline for a pause: answered at once")
}

// TestRetryWaitsWithContextWait: under WithWait, Do pauses through the
// given wait, never a timer (an hour's pace would hang the test), with
// the pace's durations exactly (no jitter), and gives up with the wait's
// error.
func TestRetryWaitsWithContextWait(t *testing.T) {
	var waits []time.Duration
	stop := errors.New("simulated deadline")
	ctx := retry.WithWait(context.Background(), func(_ context.Context, d time.Duration) error {
		waits = append(waits, d)
		if len(waits) == 4 {
			return stop
		}
		return nil
	})
	p := retry.Policy{Attempts: retry.Unlimited, Initial: time.Hour, Max: 4 * time.Hour, Multiplier: 2, Jitter: 0.5}
	err := retry.Do(ctx, p, func(context.Context) error { return retry.ErrConflict })
	require.ErrorIs(t, err, retry.ErrConflict)
	require.ErrorIs(t, err, stop, "the wait's error ends the loop")
	require.Equal(t, []time.Duration{time.Hour, 2 * time.Hour, 4 * time.Hour, 4 * time.Hour}, waits, "the pace without jitter")

	waits = nil
	busy := fmt.Errorf("too many requests: %w", retry.ErrUnavailable)
	dl, cancel := context.WithTimeout(ctx, time.Hour)
	defer cancel()
	n := 0
	err = retry.Do(dl, retry.Policy{Attempts: 1, Unavailable: true}, func(context.Context) error {
		if n++; n < 3 {
			return busy
		}
		return nil
	})
	require.NoError(t, err)
	require.Equal(t, []time.Duration{retry.UnavailablePace.Initial, 2 * retry.UnavailablePace.Initial}, waits, "unavailable retries pace through the wait too")
}
