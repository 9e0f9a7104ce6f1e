//go:build !race

package releasetest

// raceEnabled: this test binary runs under the race detector (make race).
const raceEnabled = false
