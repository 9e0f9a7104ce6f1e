package announce

import (
	"testing"

	"github.com/kvipam/kvipam/internal/testsupport/leakcheck"
)

// The watchers start a goroutine per socket or reader; none may outlive
// its test.
func TestMain(m *testing.M) { leakcheck.Main(m) }
