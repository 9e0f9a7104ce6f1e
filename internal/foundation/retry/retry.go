// Package retry is kvipam's one retry loop for compare-and-swap conflicts.
// It has no etcd import so that the pure allocator can use it too.
package retry

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/cenkalti/backoff/v4"
)

// ErrConflict marks a transaction that lost a compare-and-swap race. Retry
// retries only errors that wrap it.
var ErrConflict = errors.New("conflict")

// ErrUnavailable marks a request that could not be served because the
// store did not answer in time (unreachable, no leader, a timeout): try
// again later. Do does not retry it; callers decide how long to wait.
var ErrUnavailable = errors.New("store unavailable, try again")

// Policy bounds Do. The zero value uses Default.
type Policy struct {
	// Attempts bounds the tries; Unlimited leaves only ctx to end them,
	// for loops that make progress with every conflict.
	Attempts   int
	Initial    time.Duration
	Max        time.Duration
	Multiplier float64
	Jitter     float64 // randomization factor, spreads racing nodes apart
}

// Unlimited is the Attempts of a policy that retries until ctx ends.
const Unlimited = -1

// Default suits CAS conflicts between agents: a handful of attempts
// over well under a second.
var Default = Policy{Attempts: 8, Initial: 2 * time.Millisecond, Max: 200 * time.Millisecond, Multiplier: 2, Jitter: 0.5}

// Do runs op until it succeeds, returns an error that does not wrap
// ErrConflict, the attempts run out, or ctx ends. It is the one retry loop
// of the project: callers say what a conflict is by wrapping ErrConflict.
func Do(ctx context.Context, p Policy, op func(ctx context.Context) error) error {
	if p.Attempts == 0 {
		p = Default
	}
	eb := backoff.NewExponentialBackOff()
	eb.InitialInterval = p.Initial
	eb.MaxInterval = p.Max
	eb.Multiplier = p.Multiplier
	eb.RandomizationFactor = p.Jitter
	eb.MaxElapsedTime = 0
	var bo backoff.BackOff = eb
	if p.Attempts > 0 {
		bo = backoff.WithMaxRetries(eb, uint64(p.Attempts-1))
	}
	b := backoff.WithContext(bo, ctx)
	var last error
	err := backoff.Retry(func() error {
		last = op(ctx)
		if last == nil || !errors.Is(last, ErrConflict) {
			return backoff.Permanent(last) // nil stays nil

		}
		return last
	}, b)
	if err == nil {
		return nil
	}
	if ctx.Err() != nil && errors.Is(last, ErrConflict) {
		return fmt.Errorf("%w (gave up: %w)", last, ctx.Err())
	}
	if errors.Is(err, ErrConflict) {
		return fmt.Errorf("%d attempts: %w", p.Attempts, err)
	}
	return err
}
