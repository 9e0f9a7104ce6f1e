// Package leakcheck is the goroutine-leak check of the packages whose
// tests start goroutines with owners (the agent, the CNI plugin, the
// datapath, the kvstore): a goroutine that outlives its test fails the
// package.
package leakcheck

import (
	"testing"

	"go.uber.org/goleak"
)

// Main runs m and then fails if a goroutine is left, other than the
// long-lived ones of etcd's embedded server and gRPC, which belong to no
// test. It is a package's TestMain.
func Main(m *testing.M) {
	goleak.VerifyTestMain(m,
		goleak.IgnoreTopFunction("go.opencensus.io/stats/view.(*worker).start"),
		goleak.IgnoreAnyFunction("google.golang.org/grpc/internal/grpcsync.(*CallbackSerializer).run"),
		goleak.IgnoreAnyFunction("go.etcd.io/etcd/pkg/v3/schedule.(*fifo).run"),
	)
}
