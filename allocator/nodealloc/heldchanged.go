package nodealloc

import "sync"

// heldChanges tells the node's BGP announcer (routing.Holdings) that what
// the node holds changed where no change of homes or lease says so: the
// node learned addresses a cut-over moved (learn). Every other change of
// holdings comes with a home's change, written by the node itself under
// its lock, which the announcer's read waits behind. It is safe for
// concurrent use; it never waits on the allocator's lock.
type heldChanges struct {
	mu sync.Mutex
	ch chan struct{}
}

// next is a channel closed at the next change.
func (h *heldChanges) next() <-chan struct{} {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.ch == nil {
		h.ch = make(chan struct{})
	}
	return h.ch
}

// changed closes the channel of those waiting.
func (h *heldChanges) changed() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.ch != nil {
		close(h.ch)
		h.ch = nil
	}
}

// HeldChanged is a channel closed the next time the node learns
// addresses a cut-over moved (Learn, CutOver): its holdings changed with
// no change of homes that the node made itself.
func (a *Allocator) HeldChanged() <-chan struct{} { return a.held.next() }
