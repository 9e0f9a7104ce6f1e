package planner

import (
	"time"

	"github.com/kvipam/kvipam/allocator/records"
)

// A decision that changes what the node holds says so as an event, which
// the driver logs (and, for a lapse, records in IP history): the planner
// has no logger, and an event is data a test can read.

// EventKind is what an event reports.
type EventKind int

const (
	// Allocated starts an ownership interval (Event.Al).
	Allocated EventKind = iota
	// Ended ends one; How says how.
	Ended
	// Lapsed ends a reservation whose lease ran out at End: no release
	// records it, so the driver writes it to IP history.
	Lapsed
	// Reasserted is an allocation written back after etcd lost it.
	Reasserted
	// Note is a log line: Level, Msg and Args.
	Note
)

// Level is a note's log level.
type Level int

const (
	Debug Level = iota
	Info
	Warn
	Error
)

// Event is one thing a decision did.
type Event struct {
	Kind EventKind
	Al   records.Allocation
	How  string
	End  time.Time

	Level Level
	Msg   string
	Args  []any
}

// Events returns what happened since the last call, oldest first.
func (n *Node) Events() []Event {
	out := n.events
	n.events = nil
	return out
}

func (n *Node) allocated(al *records.Allocation) {
	n.events = append(n.events, Event{Kind: Allocated, Al: *al})
}

func (n *Node) ended(al *records.Allocation, how string) {
	n.events = append(n.events, Event{Kind: Ended, Al: *al, How: how, End: n.now()})
}

func (n *Node) note(l Level, msg string, args ...any) {
	n.events = append(n.events, Event{Kind: Note, Level: l, Msg: msg, Args: args})
}

// Ended reports the end of an allocation's interval the driver saw.
func (n *Node) Ended(al *records.Allocation, how string) { n.ended(al, how) }

// Reasserted reports an allocation written back.
func (n *Node) Reasserted(al *records.Allocation) {
	n.events = append(n.events, Event{Kind: Reasserted, Al: *al})
}

// Note reports a log line of the driver's, to keep it in order with the
// decisions' own.
func (n *Node) Note(l Level, msg string, args ...any) { n.note(l, msg, args...) }
