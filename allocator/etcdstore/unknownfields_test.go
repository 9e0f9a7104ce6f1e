package etcdstore_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/allocator/schema"
	"github.com/kvipam/kvipam/kvstore"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// fromTheFuture is the member a newer version adds to a record; this
// version does not know it.
const fromTheFuture = `{"x":[1,2]}`

// members is one JSON object's members, their values as written.
type members map[string]json.RawMessage

// TestUnknownFieldsSurviveRewrite: a record a newer version wrote with a
// member this version does not know keeps it, byte for byte, when this
// version rewrites the record, by every rewrite path of every record kind
// that has one; the known fields carry the rewrite's change.
//
// Kinds that are only ever created or deleted have no rewrite to keep a
// member through (they round-trip through the codec in FuzzUnknownFields):
//   - the deleted-pool mark: written in the delete's transaction, while
//     the pool exists and so no mark does; deleted by pool create;
//   - the block home: written with the claim of a free block, a new
//     holding (a home left by an earlier holder is replaced: it said who
//     that was); deleted with the block; a re-claim leaves it as it is;
//   - an IP history entry: written once, when an interval ends; it
//     expires with its retention lease;
//   - the node record: replaced, never rewritten from what was read. It
//     describes the agent that writes it (boot ID, version, and the
//     schema features it understands): an older agent that kept a newer
//     one's members would claim what it cannot do. The subtest "node
//     record" holds it to that.
func TestUnknownFieldsSurviveRewrite(t *testing.T) {
	ctx := context.Background()
	pool := allocator.Pool{Name: "p", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.70.0.0/24")}, BlockSizeV4: 26,
		Reserved: []allocator.Reservation{{Range: allocator.AddrRange{First: netip.MustParseAddr("10.70.0.1"), Last: netip.MustParseAddr("10.70.0.1")}, Reason: "gateway"}}}

	t.Run("pool spec", func(t *testing.T) {
		cli, st := storeOn(t)
		_, err := st.EnsurePool(ctx, pool)
		require.NoError(t, err)
		key := etcdstore.PoolKey("p")
		fromFuture(t, cli, key, func(m members) {
			var res []members
			require.NoError(t, json.Unmarshal(m["reserved"], &res))
			res[0]["fromTheFuture"] = json.RawMessage(fromTheFuture)
			m["reserved"] = encode(t, res)
		})
		keptIn := func(what string, m members) {
			var res []members
			require.NoError(t, json.Unmarshal(m["reserved"], &res))
			require.Equal(t, fromTheFuture, string(res[0]["fromTheFuture"]), "%s: the reserved range keeps its member", what)
		}

		// kvipamctl pool set-cooldown.
		cooldown := allocator.Duration(2 * time.Minute)
		_, err = st.UpdatePool(ctx, "p", func(p *allocator.Pool) error { p.ReuseCooldown = &cooldown; return nil })
		require.NoError(t, err)
		m := survived(t, cli, key, "set-cooldown")
		require.JSONEq(t, `"2m0s"`, string(m["reuseCooldown"]))
		keptIn("set-cooldown", m)

		// An agent's configuration seeds a cidr more (EnsurePool).
		grown := pool
		grown.CIDRs = append(grown.CIDRs, netip.MustParsePrefix("10.70.1.0/24"))
		_, err = st.EnsurePool(ctx, grown)
		require.NoError(t, err)
		m = survived(t, cli, key, "seed")
		require.JSONEq(t, `["10.70.0.0/24","10.70.1.0/24"]`, string(m["cidrs"]))
		require.JSONEq(t, `"2m0s"`, string(m["reuseCooldown"]), "the seed keeps the operator's setting")
		keptIn("seed", m)

		// kvipamctl pool set-max-blocks, once the cluster's level allows it.
		l, err := cli.Grant(ctx, 60)
		require.NoError(t, err)
		require.NoError(t, st.WriteNode(ctx, etcdstore.NodeRecord{Name: "a", BootID: "boot", Features: schema.Names(), StartedAt: time.Now().UTC()}, int64(l.ID)))
		_, _, err = st.RaiseSchema(ctx, schema.Highest(), "a", "v0.2.0")
		require.NoError(t, err)
		_, err = st.UpdatePool(ctx, "p", func(p *allocator.Pool) error { p.MaxBlocksPerNode = 2; return nil })
		require.NoError(t, err)
		m = survived(t, cli, key, "set-max-blocks")
		require.JSONEq(t, `2`, string(m["maxBlocksPerNode"]))
		keptIn("set-max-blocks", m)

		// kvipamctl pool remove-cidr.
		_, err = st.RemoveCIDR(ctx, "p", netip.MustParsePrefix("10.70.1.0/24"), false)
		require.NoError(t, err)
		m = survived(t, cli, key, "remove-cidr")
		require.JSONEq(t, `["10.70.0.0/24"]`, string(m["cidrs"]))
		keptIn("remove-cidr", m)
	})

	t.Run("schema setting", func(t *testing.T) {
		cli, st := storeOn(t)
		key := etcdstore.SchemaKey()
		_, err := st.EnableDowngrade(ctx, schema.Base, "v0.1.0") // held at the base level
		require.NoError(t, err)
		fromFuture(t, cli, key, nil)
		_, changed, err := st.CancelDowngrade(ctx, "v0.2.0") // kvipamctl downgrade cancel
		require.NoError(t, err)
		require.True(t, changed)
		m := survived(t, cli, key, "downgrade cancel")
		require.NotContains(t, m, "downgrade")

		// An agent raises the level once every live node understands it.
		l, err := cli.Grant(ctx, 60)
		require.NoError(t, err)
		require.NoError(t, st.WriteNode(ctx, etcdstore.NodeRecord{Name: "a", BootID: "boot", Features: schema.Names(), StartedAt: time.Now().UTC()}, int64(l.ID)))
		_, raised, err := st.RaiseSchema(ctx, schema.Highest(), "a", "v0.2.0")
		require.NoError(t, err)
		require.True(t, raised)
		m = survived(t, cli, key, "raise")
		require.JSONEq(t, fmt.Sprint(int(schema.Highest())), string(m["level"]))

		_, err = st.EnableDowngrade(ctx, schema.Base, "v0.1.0") // kvipamctl downgrade enable
		require.NoError(t, err)
		m = survived(t, cli, key, "downgrade enable")
		require.JSONEq(t, `true`, string(m["downgrade"]))
		require.JSONEq(t, fmt.Sprint(int(schema.Base)), string(m["level"]))
	})

	t.Run("history setting", func(t *testing.T) {
		cli, st := storeOn(t)
		_, err := st.PublishHistoryRetention(ctx, time.Hour, "a")
		require.NoError(t, err)
		fromFuture(t, cli, etcdstore.Prefix+"settings/history", nil)
		written, err := st.PublishHistoryRetention(ctx, 2*time.Hour, "b")
		require.NoError(t, err)
		require.True(t, written)
		m := survived(t, cli, etcdstore.Prefix+"settings/history", "a new retention")
		require.JSONEq(t, `"2h0m0s"`, string(m["retention"]))
		require.JSONEq(t, `"b"`, string(m["node"]))
	})

	t.Run("namespace binding", func(t *testing.T) {
		cli, st := storeOn(t)
		_, err := st.EnsurePool(ctx, pool)
		require.NoError(t, err)
		_, err = st.EnsurePool(ctx, allocator.Pool{Name: "q", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.71.0.0/24")}, BlockSizeV4: 26})
		require.NoError(t, err)
		require.NoError(t, st.BindNamespace(ctx, "web", "p"))
		fromFuture(t, cli, etcdstore.Prefix+"nsbindings/web", nil)
		require.NoError(t, st.BindNamespace(ctx, "web", "q")) // kvipamctl pool bind-namespace
		m := survived(t, cli, etcdstore.Prefix+"nsbindings/web", "bound again")
		require.JSONEq(t, `"q"`, string(m["pool"]))
	})

	t.Run("claim", func(t *testing.T) {
		e, cli := etcdOn(t)
		ensure(t, cli, pool)
		a := startAgent(t, e, "a")
		res, err := a.alloc.Allocate(ctx, nodealloc.Request{Pool: "p", Owner: podOwner(1)})
		require.NoError(t, err)
		key := etcdstore.ClaimKey("p", res.Allocations[0].Block)
		fromFuture(t, cli, key, nil)
		a2 := startAgent(t, e, "a") // restarted within the TTL: it re-claims its block on its new lease
		survived(t, cli, key, "re-claimed")
		require.Equal(t, a2.sess.ID(), leaseOf(t, cli, key), "the claim is on the new lease")
		require.NotEqual(t, a.sess.ID(), a2.sess.ID())
	})

	t.Run("borrower fence", func(t *testing.T) {
		cli, st := storeOn(t)
		l1, err := cli.Grant(ctx, 60)
		require.NoError(t, err)
		l2, err := cli.Grant(ctx, 60)
		require.NoError(t, err)
		c := records.Claim{Node: "b", BootID: "boot", ClaimedAt: time.Now().UTC()}
		_, err = st.FenceBorrower(ctx, c, int64(l1.ID))
		require.NoError(t, err)
		key := etcdstore.Prefix + "borrowers/b"
		fromFuture(t, cli, key, nil)
		_, err = st.FenceBorrower(ctx, c, int64(l2.ID)) // the agent restarted: its fence moves to its new lease
		require.NoError(t, err)
		survived(t, cli, key, "moved to a new lease")
		require.Equal(t, int64(l2.ID), leaseOf(t, cli, key))
	})

	t.Run("ip record", func(t *testing.T) {
		e, cli := etcdOn(t)
		ensure(t, cli, pool)
		a := startAgent(t, e, "a")
		// Confirm: a reservation a newer agent wrote, confirmed by this
		// one after it restarted (rolled back) in the ADD's middle.
		o := podOwner(1)
		res, err := a.alloc.Allocate(ctx, nodealloc.Request{Pool: "p", Owner: o, Reserve: true})
		require.NoError(t, err)
		al := res.Allocations[0]
		key := etcdstore.IPKey("p", al.Block, al.Addr)
		fromFuture(t, cli, key, nil)
		a2 := startAgent(t, e, "a")
		_, err = a2.alloc.Confirm(ctx, o)
		require.NoError(t, err)
		m := survived(t, cli, key, "confirmed")
		require.JSONEq(t, `"allocated"`, string(m["state"]))
		require.Zero(t, leaseOf(t, cli, key), "confirmed: no lease")

		// Keep: a sticky pod's DEL, after a restart that read its record.
		s1, s2 := podOwner(2), podOwner(3)
		res, err = a2.alloc.Allocate(ctx, stickyRequest(s1))
		require.NoError(t, err)
		al = res.Allocations[0]
		key = etcdstore.IPKey("p", al.Block, al.Addr)
		fromFuture(t, cli, key, nil)
		a3 := startAgent(t, e, "a")
		_, err = a3.alloc.Release(ctx, s1)
		require.NoError(t, err)
		m = survived(t, cli, key, "kept")
		require.JSONEq(t, `"kept"`, string(m["state"]))
		require.JSONEq(t, `""`, string(m["containerID"]))

		// Take over: the identity's next pod; the kept record is read
		// at the takeover.
		fromFuture(t, cli, key, func(m members) { m["fromTheFuture"] = json.RawMessage(`{"y":true}`) })
		res, err = a3.alloc.Allocate(ctx, stickyRequest(s2))
		require.NoError(t, err)
		require.Equal(t, al.Addr, res.Allocations[0].Addr)
		m = members{}
		require.NoError(t, json.Unmarshal(rawValue(t, cli, key), &m))
		require.Equal(t, `{"y":true}`, string(m["fromTheFuture"]), "taken over")
		require.JSONEq(t, `"allocated"`, string(m["state"]))
		require.JSONEq(t, `"`+s2.ContainerID+`"`, string(m["containerID"]))
	})

	t.Run("sticky binding", func(t *testing.T) {
		e, cli := etcdOn(t)
		ensure(t, cli, pool)
		a := startAgent(t, e, "a")
		s1, s2 := podOwner(2), podOwner(3)
		_, err := a.alloc.Allocate(ctx, stickyRequest(s1))
		require.NoError(t, err)
		key := etcdstore.BindingKey("p", "web/web-0")
		fromFuture(t, cli, key, nil)
		a2 := startAgent(t, e, "a")
		_, err = a2.alloc.Release(ctx, s1) // kept
		require.NoError(t, err)
		m := survived(t, cli, key, "kept")
		var owner records.Owner
		require.NoError(t, json.Unmarshal(m["owner"], &owner))
		require.Empty(t, owner.ContainerID, "kept: no pod holds it")

		fromFuture(t, cli, key, func(m members) { m["fromTheFuture"] = json.RawMessage(`{"y":true}`) })
		_, err = a2.alloc.Allocate(ctx, stickyRequest(s2)) // taken over
		require.NoError(t, err)
		m = members{}
		require.NoError(t, json.Unmarshal(rawValue(t, cli, key), &m))
		require.Equal(t, `{"y":true}`, string(m["fromTheFuture"]), "taken over")
		require.NoError(t, json.Unmarshal(m["owner"], &owner))
		require.Equal(t, s2.ContainerID, owner.ContainerID)
	})

	t.Run("lent home", func(t *testing.T) {
		e, cli := etcdOn(t)
		one := allocator.Pool{Name: "one", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.82.0.0/28")}, BlockSizeV4: 28}
		ensure(t, cli, one)
		a, b := startAgent(t, e, "a"), startAgent(t, e, "b")
		_, err := a.alloc.Allocate(ctx, nodealloc.Request{Pool: "one", Owner: podOwner(1)}) // a claims the pool's only block
		require.NoError(t, err)
		o := podOwner(2)
		res, err := b.alloc.Allocate(ctx, nodealloc.Request{Pool: "one", Owner: o, Reserve: true})
		require.NoError(t, err)
		require.True(t, res.Allocations[0].Borrowed)
		key := etcdstore.LentKey("one", res.Allocations[0].Addr)
		fromFuture(t, cli, key, nil)
		_, err = b.alloc.Confirm(ctx, o) // the lent home leaves the reservation's lease with its allocation
		require.NoError(t, err)
		m := survived(t, cli, key, "confirmed")
		require.JSONEq(t, `"b"`, string(m["node"]))
		require.Zero(t, leaseOf(t, cli, key))
	})

	t.Run("node record", func(t *testing.T) {
		cli, st := storeOn(t)
		l, err := cli.Grant(ctx, 60)
		require.NoError(t, err)
		r := etcdstore.NodeRecord{Name: "a", BootID: "boot", Version: "v0.2.0", Addresses: []string{"192.0.2.1"}, StartedAt: time.Now().UTC()}
		require.NoError(t, st.WriteNode(ctx, r, int64(l.ID)))
		fromFuture(t, cli, etcdstore.NodeKey("a"), nil)
		r.Version = "v0.1.0" // rolled back, restarted on its machine
		require.NoError(t, st.WriteNode(ctx, r, int64(l.ID)))
		m := members{}
		require.NoError(t, json.Unmarshal(rawValue(t, cli, etcdstore.NodeKey("a")), &m))
		require.NotContains(t, m, "fromTheFuture", "a node record says what the agent that wrote it is, nothing of an earlier one")
		require.JSONEq(t, `"v0.1.0"`, string(m["version"]))
	})
}

// storeOn starts an etcd for one subtest and returns a client and a store.
func storeOn(t *testing.T) (*clientv3.Client, *etcdstore.Store) {
	t.Helper()
	cli := etcdtest.Client(t, etcdtest.Start(t))
	return cli, etcdstore.New(cli, etcdstore.Options{})
}

func etcdOn(t *testing.T) (*kvstore.Embedded, *clientv3.Client) {
	t.Helper()
	e := etcdtest.Start(t)
	return e, etcdtest.Client(t, e)
}

func ensure(t *testing.T, cli *clientv3.Client, p allocator.Pool) {
	t.Helper()
	_, err := etcdstore.New(cli, etcdstore.Options{}).EnsurePool(context.Background(), p)
	require.NoError(t, err)
}

// agent is one incarnation of a node's allocator: its own client, lease
// and cache, restored from etcd as an agent's at start.
type agent struct {
	sess  *kvstore.Session
	alloc *nodealloc.Allocator
}

func startAgent(t *testing.T, e *kvstore.Embedded, node string) agent {
	t.Helper()
	ctx := context.Background()
	cli := etcdtest.Client(t, e)
	sess, err := kvstore.NewSession(ctx, cli, 30)
	require.NoError(t, err)
	t.Cleanup(sess.Close)
	al, err := nodealloc.New(nodealloc.Config{Node: node, BootID: "boot-" + node, Store: etcdstore.New(cli, etcdstore.Options{})})
	require.NoError(t, err)
	require.NoError(t, al.Restore(ctx, sess))
	return agent{sess: sess, alloc: al}
}

func podOwner(i int) records.Owner {
	return records.Owner{ContainerID: "ctr-" + string(rune('a'+i)), IfName: "eth0", Namespace: "web", Pod: "web-0"}
}

func stickyRequest(o records.Owner) nodealloc.Request {
	return nodealloc.Request{Pool: "p", Owner: o, Sticky: &records.Sticky{Identity: "web/web-0", Window: time.Minute}}
}

// fromFuture rewrites the record at key as a newer version would: with
// the member fromTheFuture added (and whatever edit changes), on the
// lease it has.
func fromFuture(t *testing.T, cli *clientv3.Client, key string, edit func(members)) {
	t.Helper()
	ctx := context.Background()
	resp, err := cli.Get(ctx, key)
	require.NoError(t, err)
	require.Len(t, resp.Kvs, 1, "%s exists", key)
	m := members{}
	require.NoError(t, json.Unmarshal(resp.Kvs[0].Value, &m))
	m["fromTheFuture"] = json.RawMessage(fromTheFuture)
	if edit != nil {
		edit(m)
	}
	var opts []clientv3.OpOption
	if l := resp.Kvs[0].Lease; l != 0 {
		opts = append(opts, clientv3.WithLease(clientv3.LeaseID(l)))
	}
	_, err = cli.Put(ctx, key, string(encode(t, m)), opts...)
	require.NoError(t, err)
}

// survived reads the record at key and requires fromTheFuture in it,
// as written; it returns the record's members.
func survived(t *testing.T, cli *clientv3.Client, key, what string) members {
	t.Helper()
	raw := rawValue(t, cli, key)
	m := members{}
	require.NoError(t, json.Unmarshal(raw, &m))
	_, ok := m["fromTheFuture"]
	require.True(t, ok, "%s: %s lost the member it does not know: %s", key, what, raw)
	require.Equal(t, fromTheFuture, string(m["fromTheFuture"]), "%s: %s: the member byte for byte", key, what)
	return m
}

func rawValue(t *testing.T, cli *clientv3.Client, key string) []byte {
	t.Helper()
	resp, err := cli.Get(context.Background(), key)
	require.NoError(t, err)
	require.Len(t, resp.Kvs, 1, "%s exists", key)
	return resp.Kvs[0].Value
}

func leaseOf(t *testing.T, cli *clientv3.Client, key string) int64 {
	t.Helper()
	resp, err := cli.Get(context.Background(), key)
	require.NoError(t, err)
	require.Len(t, resp.Kvs, 1, "%s exists", key)
	return resp.Kvs[0].Lease
}

func encode(t *testing.T, v any) json.RawMessage {
	t.Helper()
	b, err := json.Marshal(v)
	require.NoError(t, err)
	return b
}
