package keylock

import (
	"testing"
	"time"
)

// TestSameKeyWaitsOtherKeyDoesNot: a second Lock of a held key waits
// until the first unlocks; a Lock of another key does not; the entries
// are gone once all have unlocked.
func TestSameKeyWaitsOtherKeyDoesNot(t *testing.T) {
	var l Map[int]
	unlockA := l.Lock(1)
	other := make(chan func())
	go func() { other <- l.Lock(2) }()
	select {
	case unlock := <-other:
		unlock()
	case <-time.After(10 * time.Second):
		t.Fatal("a lock of another key waited for key 1")
	}
	second := make(chan func())
	go func() { second <- l.Lock(1) }()
	for l.Waiters(1) != 2 {
		time.Sleep(time.Millisecond) // until the second caller waits: no event to await
	}
	select {
	case <-second:
		t.Fatal("a second lock of key 1 did not wait for the first")
	default:
	}
	unlockA()
	select {
	case unlock := <-second:
		unlock()
	case <-time.After(10 * time.Second):
		t.Fatal("the second lock of key 1 did not get it after the unlock")
	}
	if n := l.Waiters(1) + l.Waiters(2); n != 0 {
		t.Fatalf("%d entries left after every unlock", n)
	}
}
