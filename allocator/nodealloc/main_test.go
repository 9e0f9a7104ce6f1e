package nodealloc_test

import (
	"os"
	"testing"

	"github.com/kvipam/kvipam/e2e/cluster"
)

// TestMain removes the etcd binary that the scale benchmarks' 3-member
// clusters (e2e/cluster) build.
func TestMain(m *testing.M) {
	code := m.Run()
	cluster.RemoveBinaries()
	os.Exit(code)
}
