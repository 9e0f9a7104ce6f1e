package bpf

import (
	"testing"

	"go.uber.org/goleak"
)

// Every goroutine this package starts has an owner that stops it; the
// tests check that none outlives its test. (etcd's embedded server and
// gRPC keep a few long-lived goroutines of their own.)
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		goleak.IgnoreTopFunction("go.opencensus.io/stats/view.(*worker).start"),
		goleak.IgnoreAnyFunction("google.golang.org/grpc/internal/grpcsync.(*CallbackSerializer).run"),
		goleak.IgnoreAnyFunction("go.etcd.io/etcd/pkg/v3/schedule.(*fifo).run"),
	)
}
