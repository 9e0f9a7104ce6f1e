package routing

import (
	"testing"

	"github.com/kvipam/kvipam/internal/testsupport/leakcheck"
)

// Every goroutine the package starts has an owner that stops it; the
// tests check that none outlives them.
func TestMain(m *testing.M) { leakcheck.Main(m) }
