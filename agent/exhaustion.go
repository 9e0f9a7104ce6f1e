package agent

import (
	"errors"
	"maps"
	"strings"
	"sync"

	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/prometheus/client_golang/prometheus"
)

// exhaustion remembers, per pool family, the last ADD that found the pool
// exhausted and why, for STATUS: a success in the pool, or a release,
// clears it. It is safe for concurrent use.
type exhaustion struct {
	mu     sync.Mutex
	pools  map[string]string      // "pool/family" -> the exhaustion error
	errors *prometheus.CounterVec // by pool and family; nil in tests
}

// note records the outcome of an allocation request.
func (e *exhaustion) note(req nodealloc.Request, err error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	var ee *records.ExhaustedError
	if errors.As(err, &ee) {
		if e.pools == nil {
			e.pools = map[string]string{}
		}
		e.pools[ee.Pool+"/"+ee.Family.String()] = ee.Error()
		if e.errors != nil {
			e.errors.WithLabelValues(ee.Pool, ee.Family.String()).Inc()
		}
		return
	}
	if err == nil {
		for k := range e.pools {
			if strings.HasPrefix(k, req.Pool+"/") {
				delete(e.pools, k)
			}
		}
	}
}

// clear forgets every note: addresses were freed.
func (e *exhaustion) clear() {
	e.mu.Lock()
	clear(e.pools)
	e.mu.Unlock()
}

// snapshot returns the pool families noted exhausted, with why.
func (e *exhaustion) snapshot() map[string]string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return maps.Clone(e.pools)
}
