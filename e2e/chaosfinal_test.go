package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/e2e/chaos"
	"github.com/kvipam/kvipam/kvstore"
)

// What a chaos run reads at its end: etcd's allocations and bindings,
// IP history as an operator reads it, and a failing run's history kept
// for replay.

// chaosFinal is what etcd holds once the run is over: every allocation
// record, and the chaos pool's sticky bindings.
func chaosFinal(t *testing.T, cli *clientv3.Client) chaos.Final {
	resp, err := cli.Get(context.Background(), etcdstore.AllIPsPrefix(), clientv3.WithPrefix())
	require.NoError(t, err)
	final := chaos.Final{Records: map[netip.Addr]chaos.Holder{}, Bindings: map[string]chaos.BindingChange{}}
	for _, kv := range resp.Kvs {
		k, _ := etcdstore.ParseKey(string(kv.Key))
		if al, err := etcdstore.DecodeAllocation(k.Pool, kv); err == nil {
			final.Records[al.Addr] = chaos.HolderOf(al.Record)
		}
	}
	resp, err = cli.Get(context.Background(), etcdstore.StickyPrefix("chaos"), clientv3.WithPrefix())
	require.NoError(t, err)
	for _, kv := range resp.Kvs {
		if b, err := kvstore.Decode[records.Binding](kv); err == nil {
			final.Bindings[b.Value.Identity] = chaos.BindingOf(b.Value, chaos.BindingChange{Identity: b.Value.Identity, Rev: kv.ModRevision})
		}
	}
	return final
}

// ipHistory reads the ended ownership intervals of every address of
// pool from kvipamctl ip history, as an operator would.
func ipHistory(t *testing.T, ctl func(args ...string) ([]byte, error), pool netip.Prefix) []chaos.Interval {
	var ivs []chaos.Interval
	for a := pool.Addr().Next(); pool.Contains(a.Next()); a = a.Next() {
		out, err := ctl("ip", "history", a.String(), "--pool", "chaos", "-o", "json")
		require.NoError(t, err, "kvipamctl ip history %s: %s", a, out)
		var rows []struct {
			etcdstore.HistoryRecord
			Current bool `json:"current"`
		}
		require.NoError(t, json.Unmarshal(out, &rows), "kvipamctl ip history %s -o json", a)
		for _, r := range rows {
			if !r.Current {
				ivs = append(ivs, chaos.Interval{Addr: a, Owner: r.Owner.Key(), Start: r.Start, End: r.End, Reason: r.Reason})
			}
		}
	}
	return ivs
}

// keepHistory writes a failing run's history and the agents' logs beside
// its seed, for replay.
func keepHistory(t *testing.T, seed uint64, ops []chaos.Op, changes []chaos.Change, bindings []chaos.BindingChange, members []*chaosNode) {
	dir := filepath.Join(os.TempDir(), fmt.Sprintf("kvipam-chaos-%d", seed))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return
	}
	b, _ := json.MarshalIndent(map[string]any{"seed": seed, "ops": ops, "changes": changes, "bindings": bindings}, "", " ")
	_ = os.WriteFile(filepath.Join(dir, "history.json"), b, 0o644)
	for _, m := range members {
		if log, err := os.ReadFile(m.n.agentLog); err == nil {
			_ = os.WriteFile(filepath.Join(dir, m.n.name+"-agent.log"), log, 0o644)
		}
	}
	t.Logf("chaos: history and agent logs kept in %s", dir)
}
