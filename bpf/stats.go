//go:build linux

package bpf

import "fmt"

// Counters are the traffic an endpoint's host veth received from the pod,
// summed over CPUs. Bytes include the Ethernet header.
type Counters struct {
	PassedPackets  uint64
	PassedBytes    uint64
	DroppedPackets uint64
	DroppedBytes   uint64
}

func (c *Counters) add(v kvipamCounters) {
	c.PassedPackets += v.PassedPackets
	c.PassedBytes += v.PassedBytes
	c.DroppedPackets += v.DroppedPackets
	c.DroppedBytes += v.DroppedBytes
}

// Stats returns the counters of every attached endpoint by endpoint ID. ID 0,
// present only when non-zero, counts frames dropped on an interface that
// runs the program but has no endpoint (the program fails closed).
//
// Stats does not wait for attaches in flight: it holds mu shared and
// mapsMu, so no entry is deleted while it walks the counters.
func (d *Datapath) Stats() (map[uint32]Counters, error) {
	if err := d.rlock(); err != nil {
		return nil, err
	}
	defer d.mu.RUnlock()
	d.mapsMu.Lock()
	defer d.mapsMu.Unlock()

	out := make(map[uint32]Counters)
	var (
		id     uint32
		percpu []kvipamCounters
	)
	it := d.objs.KvipamCounters.Iterate()
	for it.Next(&id, &percpu) {
		var sum Counters
		for _, v := range percpu {
			sum.add(v)
		}
		if id == 0 && sum == (Counters{}) {
			continue
		}
		out[id] = sum
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("iterate counters: %w", err)
	}
	return out, nil
}
