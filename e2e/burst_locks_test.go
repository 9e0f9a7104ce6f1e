package e2e

import (
	"errors"
	"os"
	"testing"
	"time"

	"github.com/kvipam/kvipam/internal/tools/locktrace"
)

// lockTraceEnv, set to 1, makes BenchmarkBurst100 trace the kernel's
// mutex waits during each measured burst (internal/tools/locktrace) and report,
// per configuration, the ADDs' mean wait for rtnl (<name>-rtnl-wait-ms),
// how much of the burst rtnl had a queue (<name>-rtnl-queue-pct), and log
// who waited where. Off by default: tracing with stacks slows the waits
// it measures a little.
const lockTraceEnv = "KVIPAM_LOCK_TRACE"

// burstLocks sums the lock traces of each configuration's bursts.
type burstLocks struct {
	b       *testing.B
	on      bool
	waits   map[string]time.Duration // rtnl waits of every task, by name
	queue   map[string]time.Duration // time rtnl had a queue
	window  map[string]time.Duration
	summary map[string]string // of the last burst
}

func newBurstLocks(b *testing.B) *burstLocks {
	return &burstLocks{b: b, on: os.Getenv(lockTraceEnv) == "1",
		waits: map[string]time.Duration{}, queue: map[string]time.Duration{}, window: map[string]time.Duration{}, summary: map[string]string{}}
}

// start begins tracing a burst of name; call the function it returns when
// the burst is over.
func (l *burstLocks) start(name string) (stop func()) {
	if !l.on {
		return func() {}
	}
	tr, err := locktrace.Start("kvipam-burst")
	if errors.Is(err, locktrace.ErrUnsupported) {
		l.b.Logf("%s=1 but %v: not traced", lockTraceEnv, err)
		l.on = false
		return func() {}
	}
	if err != nil {
		l.b.Fatalf("lock trace: %v", err)
	}
	return func() {
		r, err := tr.Stop()
		if err != nil {
			l.b.Fatalf("lock trace: %v", err)
		}
		_, d := r.Total(locktrace.IsRTNL)
		l.waits[name] += d
		l.queue[name] += r.Busy(locktrace.IsRTNL)
		l.window[name] += r.Window
		l.summary[name] = r.Summary()
	}
}

// report reports each configuration's figures over all its bursts of
// pods ADDs each, and logs the last burst's summary.
func (l *burstLocks) report(names []string, bursts, pods int) {
	if !l.on {
		return
	}
	for _, name := range names {
		l.b.ReportMetric(ms(l.waits[name])/float64(bursts*pods), name+"-rtnl-wait-ms")
		if l.window[name] > 0 {
			l.b.ReportMetric(100*float64(l.queue[name])/float64(l.window[name]), name+"-rtnl-queue-pct")
		}
		l.b.Logf("%s, last burst's mutex waits:\n%s", name, l.summary[name])
	}
}
