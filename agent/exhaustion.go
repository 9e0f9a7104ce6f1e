package agent

import (
	"errors"
	"maps"
	"strings"
	"sync"

	"github.com/kvipam/kvipam/allocator"
)

// exhaustion remembers which pool families last failed to find a block,
// for STATUS: a success in the pool, or a release, clears it. It is safe
// for concurrent use.
type exhaustion struct {
	mu    sync.Mutex
	pools map[string]bool // "pool/family"
}

// note records the outcome of an allocation request.
func (e *exhaustion) note(req allocator.Request, err error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	var ee *allocator.ExhaustedError
	if errors.As(err, &ee) {
		if e.pools == nil {
			e.pools = map[string]bool{}
		}
		e.pools[ee.Pool+"/"+ee.Family.String()] = true
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

// snapshot returns the pool families noted exhausted.
func (e *exhaustion) snapshot() map[string]bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return maps.Clone(e.pools)
}
