// Package retry is kvipam's one retry loop: for compare-and-swap
// conflicts, and, inside a request's deadline, for a store that did not
// answer in time.
// It has no etcd import so that the pure allocator can use it too.
package retry

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/cenkalti/backoff/v4"
)

// ErrConflict, ErrUnavailable and ErrRefused are defined here, the lowest
// layer that must recognise them, and named so only here and in kvstore
// (the etcd layer, below allocator/records). Every package above the
// records names them retry.ErrConflict, retry.ErrUnavailable and
// retry.ErrRefused, the store contract's names.
//
// ErrConflict marks a transaction that lost a compare-and-swap race. Retry
// retries only errors that wrap it.
var ErrConflict = errors.New("conflict")

// ErrUnavailable marks a request that could not be served because the
// store did not answer in time (unreachable, no leader, a timeout): try
// again later. Do retries it only under Policy.Unavailable, inside the
// deadline of the caller's context.
var ErrUnavailable = errors.New("store unavailable, try again")

// ErrRefused marks a request the store refused before acting on it
// (etcd's "too many requests", a proposal raft dropped): nothing of it
// was applied, so a write refused so has a known outcome. It always comes
// with ErrUnavailable: try again.
var ErrRefused = errors.New("refused before it was applied")

// Policy bounds Do. The zero value uses Default.
type Policy struct {
	// Attempts bounds the tries; Unlimited leaves only ctx to end them,
	// for loops that make progress with every conflict.
	Attempts   int
	Initial    time.Duration
	Max        time.Duration
	Multiplier float64
	Jitter     float64 // randomization factor, spreads racing nodes apart
	// Unavailable, if set, retries errors that wrap ErrUnavailable too,
	// paced by UnavailablePace, as long as ctx has a deadline that
	// leaves room for the pause before the next attempt. They do not
	// count against Attempts. A request is then answered "try again"
	// only when its own deadline nears, not at the store's first slow
	// or refused answer. A ctx with no deadline gets no such retry:
	// nothing would bound the wait.
	Unavailable bool
}

// Unlimited is the Attempts of a policy that retries until ctx ends.
const Unlimited = -1

// Default suits CAS conflicts between agents: a handful of attempts
// over well under a second.
var Default = Policy{Attempts: 8, Initial: 2 * time.Millisecond, Max: 200 * time.Millisecond, Multiplier: 2, Jitter: 0.5}

// UnavailablePace paces retries of ErrUnavailable (Policy.Unavailable):
// a store that is loaded (too many requests, a request past its call
// timeout) is given a moment, more with each failure, and racing
// callers are spread apart.
var UnavailablePace = Policy{Initial: 20 * time.Millisecond, Max: 500 * time.Millisecond, Multiplier: 2, Jitter: 0.5}

// Wait is a pause between two attempts of Do: it returns when d has
// passed, or an error to give up with (as when ctx ends).
type Wait func(ctx context.Context, d time.Duration) error

type waitKey struct{}

// WithWait returns a context under which Do pauses with wait instead of
// a timer, and without jitter: a simulation whose time is a fake clock
// passes one that moves that clock, so that no retry sleeps for real and
// a seed replays exactly. The deadline Policy.Unavailable leaves room
// within is still ctx's.
func WithWait(ctx context.Context, wait Wait) context.Context {
	return context.WithValue(ctx, waitKey{}, wait)
}

func waitOf(ctx context.Context) Wait {
	w, _ := ctx.Value(waitKey{}).(Wait)
	return w
}

func (p Policy) backOff() *backoff.ExponentialBackOff {
	eb := backoff.NewExponentialBackOff()
	eb.InitialInterval = p.Initial
	eb.MaxInterval = p.Max
	eb.Multiplier = p.Multiplier
	eb.RandomizationFactor = p.Jitter
	eb.MaxElapsedTime = 0
	eb.Reset()
	return eb
}

// Do runs op until it succeeds, returns an error that does not wrap
// ErrConflict (nor ErrUnavailable, under Policy.Unavailable), the
// attempts run out, or ctx ends. It is the one retry loop of the
// project: callers say what a conflict is by wrapping ErrConflict.
func Do(ctx context.Context, p Policy, op func(ctx context.Context) error) error {
	if p.Attempts == 0 {
		p = Policy{Attempts: Default.Attempts, Initial: Default.Initial, Max: Default.Max, Multiplier: Default.Multiplier, Jitter: Default.Jitter, Unavailable: p.Unavailable}
	}
	pace, wait := UnavailablePace, waitOf(ctx)
	if wait != nil {
		p.Jitter, pace.Jitter = 0, 0
	}
	conflicts, unavailable := p.backOff(), pace.backOff()
	for attempt := 1; ; attempt++ {
		err := op(ctx)
		if err == nil {
			return nil
		}
		var d time.Duration
		switch {
		case errors.Is(err, ErrConflict):
			if p.Attempts > 0 && attempt >= p.Attempts {
				return fmt.Errorf("%d attempts: %w", p.Attempts, err)
			}
			d = conflicts.NextBackOff()
		case p.Unavailable && errors.Is(err, ErrUnavailable):
			d = unavailable.NextBackOff()
			if !roomFor(ctx, d) {
				return err
			}
			attempt-- // not counted against Attempts
		default:
			return err
		}
		if wait != nil {
			if werr := wait(ctx, d); werr != nil {
				return fmt.Errorf("%w (gave up: %w)", err, werr)
			}
			continue
		}
		t := time.NewTimer(d)
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("%w (gave up: %w)", err, ctx.Err())
		case <-t.C:
		}
	}
}

// roomFor reports whether ctx has a deadline later than a pause of wait
// from now.
func roomFor(ctx context.Context, wait time.Duration) bool {
	dl, ok := ctx.Deadline()
	return ok && ctx.Err() == nil && time.Until(dl) > wait
}
