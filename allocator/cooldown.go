package allocator

import (
	"encoding/json"
	"fmt"
	"time"

	"github.com/kvipam/kvipam/internal/foundation/duration"
)

// Reuse cooldown. A released address of a pool is not handed out again
// for the pool's cooldown, unless nothing else in a node's blocks is free,
// so that what others remember of its last pod (a peer's conntrack entry,
// a neighbour cache, a DNS answer, a late packet) does not reach the next
// one. Every node applies the same cooldown, to its own blocks and to the
// addresses it borrows from another node's, so it is the pool's setting,
// in etcd, not a node's.

// DefaultReuseCooldown is the cooldown of a pool whose spec sets none.
const DefaultReuseCooldown = 30 * time.Second

// MaxReuseCooldown bounds a pool's cooldown: what it waits out is short
// lived (Linux conntrack's default timeouts of an entry that is not
// established are at most 120 s, SYN_SENT, TIME_WAIT and a UDP stream,
// and 300 s for unacknowledged data), and a longer one only keeps more
// addresses cooling.
const MaxReuseCooldown = time.Hour

// Duration is a time.Duration written in JSON as Go writes it ("30s",
// "2m0s"), so a person reading the pool key in etcd reads it as such.
type Duration time.Duration

// DurationOf is d as a pool setting.
func DurationOf(d time.Duration) *Duration {
	v := Duration(d)
	return &v
}

// MarshalJSON writes d as a Go duration string.
func (d Duration) MarshalJSON() ([]byte, error) { return json.Marshal(time.Duration(d).String()) }

// UnmarshalJSON reads a Go duration string such as "30s" or "2m", or 0,
// as an agent's configuration file writes durations
// (duration.Decode).
func (d *Duration) UnmarshalJSON(b []byte) error {
	v, err := duration.Decode(b)
	if err != nil {
		return err
	}
	*d = Duration(v)
	return nil
}

// String is d as Go writes a duration.
func (d Duration) String() string { return time.Duration(d).String() }

// Cooldown is how long a released address of p is not handed out again:
// its ReuseCooldown, or DefaultReuseCooldown when it sets none.
func (p Pool) Cooldown() time.Duration {
	if p.ReuseCooldown == nil {
		return DefaultReuseCooldown
	}
	return time.Duration(*p.ReuseCooldown)
}

// ValidateCooldown reports whether d may be a pool's reuse cooldown,
// wrapping ErrInvalidPool.
func ValidateCooldown(d time.Duration) error {
	if d < 0 || d > MaxReuseCooldown {
		return fmt.Errorf("%w: reuseCooldown %s: want 0 (reuse at once) to %s", ErrInvalidPool, d, MaxReuseCooldown)
	}
	return nil
}
