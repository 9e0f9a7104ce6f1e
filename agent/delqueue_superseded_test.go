package agent

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/agent/delqueue"
	"github.com/kvipam/kvipam/allocator/records"
)

// TestQueuedDelSupersededOnlyByANewAttachment: a queued DEL is dropped
// only when its owner attached again after it was queued (an endpoint
// created, or a reservation made, later). An allocation handed to the
// owner later (a live migration's hand-over or cut-over) does not
// supersede it: the chaos run of 3 Dec (seed 1796307319440164445) had a
// migration target's DEL queued across a power cut, the forwarding
// owner's DEL then handed the addresses to it, and the drain dropped the
// queued DEL as older than the allocation: the addresses and the binding
// leaked to a pod that was gone.
func TestQueuedDelSupersededOnlyByANewAttachment(t *testing.T) {
	queued := time.Date(2026, 12, 3, 14, 16, 24, 698_000_000, time.UTC)
	e := delqueue.Entry{Owner: api.Owner{ContainerID: "ctr-virt-launcher-vm0-12-target", IfName: "eth0"}, QueuedAt: queued}
	handedOver := records.Allocation{Record: records.Record{State: records.StateAllocated, Since: queued.Add(89 * time.Millisecond)}}
	attachedBefore := api.Endpoint{Created: queued.Add(-13 * time.Second)}

	_, later := queuedDelSuperseded(e, attachedBefore, true, []records.Allocation{handedOver})
	require.False(t, later, "handed over after the DEL was queued; the pod attached before it")
	_, later = queuedDelSuperseded(e, api.Endpoint{}, false, []records.Allocation{handedOver})
	require.False(t, later, "handed over, its endpoint not restored yet")

	at, later := queuedDelSuperseded(e, api.Endpoint{Created: queued.Add(time.Second)}, true, nil)
	require.True(t, later, "a new endpoint of the same owner after the DEL")
	require.Equal(t, queued.Add(time.Second), at)
	reserved := records.Allocation{Record: records.Record{State: records.StateReserved, Since: queued.Add(time.Second)}}
	_, later = queuedDelSuperseded(e, api.Endpoint{}, false, []records.Allocation{reserved})
	require.True(t, later, "a new ADD's reservation, its endpoint not made yet")
	_, later = queuedDelSuperseded(delqueue.Entry{Owner: e.Owner}, api.Endpoint{Created: queued.Add(time.Second)}, true, nil)
	require.False(t, later, "an entry with no time is always applied")
}
