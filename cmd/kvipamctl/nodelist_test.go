package main

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/inspect"
)

// TestNodeListShowsVersionAndLabels: node list names each live agent's
// version and labels, from its node record (table and JSON).
func TestNodeListShowsVersionAndLabels(t *testing.T) {
	h := newHarness(t)
	h.put(etcdstore.NodeKey("worker-1"), etcdstore.NodeRecord{Name: "worker-1", BootID: "b1", Version: "v1.4.0-2-gabc1234",
		Addresses: []string{"10.0.0.11"}, Labels: map[string]string{"zone": "a", "rack": "r1"}, StartedAt: time.Now()})
	h.put(etcdstore.NodeKey("worker-2"), etcdstore.NodeRecord{Name: "worker-2", BootID: "b2", Version: "v1.3.9", StartedAt: time.Now()})

	out := h.ok("node", "list")
	require.Contains(t, out, "LABELS")
	require.Regexp(t, `worker-1\s+true\s+b1\s+10\.0\.0\.11\s+v1\.4\.0-2-gabc1234\s+rack=r1,zone=a\s`, out)
	require.Regexp(t, `worker-2\s+true\s+b2\s+-\s+v1\.3\.9\s+-\s`, out)

	var rows []inspect.NodeRow
	require.Equal(t, exitOK, h.json(&rows, "node", "list"))
	require.Len(t, rows, 2)
	require.Equal(t, "v1.4.0-2-gabc1234", rows[0].Version)
	require.Equal(t, map[string]string{"rack": "r1", "zone": "a"}, rows[0].Labels)
	require.Empty(t, rows[1].Labels)
}
