// Package duration reads a duration from a configuration value (a file, a
// pool spec in etcd) as the flags take it. It imports nothing of kvipam
// and no decoder, so the pure allocator can use it.
package duration

import (
	"encoding/json"
	"fmt"
	"strconv"
	"time"
)

// Decode reads a duration from the JSON value b as a configuration
// file writes it, as the flags take it: a Go duration string ("1s",
// "500ms", "2m30s"), or the number 0. Any other bare number is refused,
// since it names no unit ("callTimeout: 1" could be a second or a
// nanosecond). A configuration's Duration type calls it from its
// UnmarshalJSON.
func Decode(b []byte) (time.Duration, error) {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		if n, nerr := strconv.ParseFloat(string(b), 64); nerr == nil {
			if n == 0 {
				return 0, nil
			}
			return 0, fmt.Errorf("%s has no unit: write a duration as the flags take it, such as %q or %q", b, "1s", "500ms")
		}
		return 0, fmt.Errorf("%s is not a duration: write one as the flags take it, such as %q or %q", b, "1s", "500ms")
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		return 0, fmt.Errorf("%q is not a duration such as %q or %q: %w", s, "1s", "500ms", err)
	}
	return d, nil
}
