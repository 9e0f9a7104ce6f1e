package nodealloc_test

import (
	"context"
	"errors"
	"net/netip"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
)

// stormSteps times a storm node's store calls by kind (the claim
// transactions, the allocation writes, the read backs...): each call's
// duration and when it ended, in ms after the storm's start, and the
// calls that failed with ErrUnavailable (retried inside the request's
// deadline).
type stormSteps struct {
	mu    sync.Mutex
	began time.Time
	steps map[string]*stormStep
}

type stormStep struct {
	took, starts, ends []float64
	unavailable        int
}

func (s *stormSteps) start() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.began = time.Now()
	s.steps = map[string]*stormStep{}
}

// stop stops recording.
func (s *stormSteps) stop() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.steps = nil
}

// p99 is the p99 of the calls of kind op recorded since start (0 if none).
func (s *stormSteps) p99(op string) time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := s.steps[op]
	if st == nil {
		return 0
	}
	took := make([]time.Duration, len(st.took))
	for i, v := range st.took {
		took[i] = time.Duration(v * float64(time.Millisecond))
	}
	return quantile(took, 0.99)
}

// time runs f, the store call op, and records it (once the storm began).
func (s *stormSteps) time(op string, f func() error) {
	t := time.Now()
	err := f()
	end := time.Now()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.steps == nil {
		return
	}
	st := s.steps[op]
	if st == nil {
		st = &stormStep{}
		s.steps[op] = st
	}
	st.took = append(st.took, ms(end.Sub(t)))
	st.starts = append(st.starts, ms(t.Sub(s.began)))
	st.ends = append(st.ends, ms(end.Sub(s.began)))
	if errors.Is(err, retry.ErrUnavailable) {
		st.unavailable++
	}
}

// report reports, per kind of call, how many there were, how many etcd did
// not answer in time, their p50 and p99, when the first started and
// ended, and when half had started.
func (s *stormSteps) report(b *testing.B) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for op, st := range s.steps {
		took := make([]time.Duration, len(st.took))
		for i, v := range st.took {
			took[i] = time.Duration(v * float64(time.Millisecond))
		}
		first := slices.Min(st.ends)
		starts := make([]time.Duration, len(st.starts))
		for i, v := range st.starts {
			starts[i] = time.Duration(v * float64(time.Millisecond))
		}
		b.ReportMetric(slices.Min(st.starts), op+"-first-start-ms")
		b.ReportMetric(ms(quantile(starts, 0.5)), op+"-start-p50-ms")
		b.ReportMetric(float64(len(st.took)), op+"-calls")
		b.ReportMetric(float64(st.unavailable), op+"-unavailable")
		b.ReportMetric(ms(quantile(took, 0.5)), op+"-p50-ms")
		b.ReportMetric(ms(quantile(took, 0.99)), op+"-p99-ms")
		b.ReportMetric(first, op+"-first-end-ms")
	}
}

// timedStore times every call a storm node makes (stormSteps).
type timedStore struct {
	records.Store
	s *stormSteps
}

func (t timedStore) Claim(ctx context.Context, pool string, b netip.Prefix, cl records.Claim, lease int64) (res records.WriteResult, err error) {
	t.s.time("claim", func() error { res, err = t.Store.Claim(ctx, pool, b, cl, lease); return err })
	return res, err
}

func (t timedStore) WriteIPs(ctx context.Context, w []records.IPWrite) (res records.WriteResult, err error) {
	t.s.time("write", func() error { res, err = t.Store.WriteIPs(ctx, w); return err })
	return res, err
}

func (t timedStore) DeleteIP(ctx context.Context, al records.Allocation) (err error) {
	t.s.time("delete", func() error { err = t.Store.DeleteIP(ctx, al); return err })
	return err
}

func (t timedStore) GetIPs(ctx context.Context, refs []records.IPRef) (out map[netip.Addr]records.Allocation, err error) {
	t.s.time("readback", func() error { out, err = t.Store.GetIPs(ctx, refs); return err })
	return out, err
}

func (t timedStore) ListBlocks(ctx context.Context, pool string) (out []records.BlockInfo, err error) {
	t.s.time("listblocks", func() error { out, err = t.Store.ListBlocks(ctx, pool); return err })
	return out, err
}

func (t timedStore) PeekBlocks(ctx context.Context, pool string, blocks []netip.Prefix) (out map[netip.Prefix]records.BlockInfo, err error) {
	t.s.time("peek", func() error { out, err = t.Store.PeekBlocks(ctx, pool, blocks); return err })
	return out, err
}
