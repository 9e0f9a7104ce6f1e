package cluster_test

import (
	"os"
	"testing"

	"go.uber.org/goleak"

	"github.com/kvipam/kvipam/e2e/cluster"
)

// The harness starts goroutines (one per member process, one launcher per
// cluster); the tests check that none outlives its test, and remove the
// etcd binary at the end.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		goleak.IgnoreAnyFunction("google.golang.org/grpc/internal/grpcsync.(*CallbackSerializer).run"),
		goleak.Cleanup(func(code int) {
			cluster.RemoveBinaries()
			os.Exit(code)
		}),
	)
}
