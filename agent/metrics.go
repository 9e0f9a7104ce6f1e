package agent

import (
	"context"
	"errors"
	"net/netip"
	"time"

	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the agent's Prometheus series, on a registry of its own (no
// global state), served on --metrics-addr.
type metrics struct {
	reg        *prometheus.Registry
	txn        *prometheus.HistogramVec
	conflicts  *prometheus.CounterVec
	batch      prometheus.Histogram
	leaseHeld  prometheus.Gauge
	nameTaken  prometheus.Gauge
	lostEPs    prometheus.Gauge
	reasserted prometheus.Counter
	gcReleased *prometheus.CounterVec
	requests   *prometheus.CounterVec
	exhausted  *prometheus.CounterVec
}

// newMetrics makes the agent's series; version labels kvipam_build_info.
func newMetrics(version string) *metrics {
	m := &metrics{
		reg: prometheus.NewRegistry(),
		txn: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvipam_etcd_txn_duration_seconds", Help: "Latency of the allocator's etcd operations.",
			Buckets: prometheus.ExponentialBuckets(0.0001, 2, 16),
		}, []string{"op"}),
		conflicts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvipam_cas_conflicts_total", Help: "Compare-and-swap transactions that lost a race or a fence.",
		}, []string{"op"}),
		batch: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "kvipam_allocation_batch_size", Help: "Allocation requests per etcd transaction (group commit).",
			Buckets: []float64{1, 2, 4, 8, 16, 32, 64, 128, 256},
		}),
		leaseHeld: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvipam_lease_held", Help: "1 while the node holds its etcd lease.",
		}),
		nameTaken: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvipam_node_name_conflict",
			Help: "1 once another agent (another boot ID or node addresses) was found holding this node's name: the agent then serves no new ADDs until it is restarted.",
		}),
		lostEPs: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvipam_endpoints_lost",
			Help: "Endpoints found since the agent started whose owner no longer held their addresses after a restore: the node's blocks were freed while it was away.",
		}),
		reasserted: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvipam_reasserted_total",
			Help: "Allocations of running endpoints written back after etcd had lost them (restored from an older snapshot).",
		}),
		gcReleased: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvipam_gc_released_total", Help: "Allocations released by garbage collection.",
		}, []string{"source"}),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvipam_api_requests_total", Help: "API requests by path and status.",
		}, []string{"path", "code"}),
		exhausted: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvipam_pool_exhaustion_errors_total", Help: "ADDs refused because the pool had no free address (none to claim or borrow).",
		}, []string{"pool", "family"}),
	}
	m.reg.MustRegister(m.txn, m.conflicts, m.batch, m.leaseHeld, m.nameTaken, m.lostEPs, m.reasserted, m.gcReleased, m.requests, m.exhausted,
		buildInfo(version))
	return m
}

// instrumentedStore times every store operation and counts conflicts.
type instrumentedStore struct {
	records.Store
	m *metrics
}

var _ records.Store = instrumentedStore{}

func (s instrumentedStore) observe(op string, start time.Time, err error) {
	s.m.txn.WithLabelValues(op).Observe(time.Since(start).Seconds())
	if errors.Is(err, retry.ErrConflict) {
		s.m.conflicts.WithLabelValues(op).Inc()
	}
}

func (s instrumentedStore) Claim(ctx context.Context, pool string, b netip.Prefix, c records.Claim, lease int64) (records.WriteResult, error) {
	start := time.Now()
	res, err := s.Store.Claim(ctx, pool, b, c, lease)
	s.observe("claim", start, err)
	return res, err
}

func (s instrumentedStore) Reclaim(ctx context.Context, pool string, prev records.BlockInfo, c records.Claim, lease int64) (int64, error) {
	start := time.Now()
	rev, err := s.Store.Reclaim(ctx, pool, prev, c, lease)
	s.observe("reclaim", start, err)
	return rev, err
}

func (s instrumentedStore) WriteIPs(ctx context.Context, w []records.IPWrite) (records.WriteResult, error) {
	start := time.Now()
	res, err := s.Store.WriteIPs(ctx, w)
	s.observe("write_ips", start, err)
	return res, err
}

func (s instrumentedStore) DeleteIP(ctx context.Context, al records.Allocation) error {
	start := time.Now()
	err := s.Store.DeleteIP(ctx, al)
	s.observe("delete_ip", start, err)
	return err
}
