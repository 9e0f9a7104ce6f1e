package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/allocator/schema"
	"github.com/kvipam/kvipam/internal/foundation/jsonkeep"
	"github.com/kvipam/kvipam/internal/foundation/retry"
	"github.com/kvipam/kvipam/kvstore"
)

// SchemaSetting is the value of the schema key: the cluster's schema
// level (allocator/schema). Absent, the level is schema.Base. The agents
// raise it once every live node understands the next level
// (RaiseSchema); an operator lowers and holds it for a downgrade
// (EnableDowngrade) and lets it go (CancelDowngrade).
type SchemaSetting struct {
	Level schema.Level `json:"level"`
	// Downgrade is set while an operator holds the level for a downgrade:
	// the agents do not raise it.
	Downgrade bool `json:"downgrade,omitempty"`
	// By is who wrote it (a node, or "kvipamctl") and Version its version.
	By      string    `json:"by,omitempty"`
	Version string    `json:"version,omitempty"`
	At      time.Time `json:"at"`
	// Rev is the revision it was written at (not stored); 0: absent.
	Rev int64 `json:"-"`
	// Unknown: members this version does not know (jsonkeep).
	jsonkeep.Unknown `json:"-"`
}

// rewritten is cur as a write changes it: what a newer version wrote in
// it stays (docs/etcd-schema.md, "Fields a version does not know").
func rewritten(cur SchemaSetting, level schema.Level, downgrade bool, by, version string, at time.Time) SchemaSetting {
	next := cur
	next.Level, next.Downgrade, next.By, next.Version, next.At, next.Rev = level, downgrade, by, version, at, 0
	return next
}

// ErrNodesAway is returned by RaiseSchema when a raise waits for nodes
// that hold blocks or borrowed addresses but have no live record: their
// version is unknown until they come back (or kvipamctl node remove
// frees what they held). The error names them.
var ErrNodesAway = errors.New("nodes away")

// ErrSchemaLevel marks a write or a start that the cluster's schema level
// does not allow: a feature not every live node understands, a level
// this binary does not know, a downgrade below a level in use.
var ErrSchemaLevel = errors.New("schema level")

// SchemaKey is the cluster's schema level (SchemaSetting); no lease.
func SchemaKey() string { return Prefix + "settings/schema" }

// ReadSchema reads the cluster's schema level.
func (s *Store) ReadSchema(ctx context.Context) (SchemaSetting, error) {
	v, err := kvstore.GetJSON[SchemaSetting](ctx, s.kv, SchemaKey())
	switch {
	case errors.Is(err, kvstore.ErrNotFound):
		return SchemaSetting{Level: schema.Base}, nil
	case err != nil:
		return SchemaSetting{}, fmt.Errorf("read the schema level: %w", err)
	case v.Value.Level < schema.Base:
		return SchemaSetting{}, fmt.Errorf("read the schema level: %s holds level %d", SchemaKey(), v.Value.Level)
	}
	v.Value.Rev = v.ModRevision
	return v.Value, nil
}

// NodeLevel is a live node's schema level, from the features its record
// names (schema.LevelOf).
func NodeLevel(r NodeRecord) schema.Level { return schema.LevelOf(r.Features) }

// settingUnchanged is the compare "the schema key is as read".
func settingUnchanged(cur SchemaSetting) clientv3.Cmp {
	return clientv3.Compare(clientv3.ModRevision(SchemaKey()), "=", cur.Rev)
}

// awayNodes names the nodes that hold a block home or a lent address's
// home but have no live record among live: a node down, rebooting or cut
// off, which may come back as any release. The cluster counts them as
// etcd counts a member that is down: their level is unknown, so the
// base level.
func (s *Store) awayNodes(ctx context.Context, live []NodeRecord) ([]string, error) {
	resp, err := s.kv.Get(ctx, AllHomesPrefix(), clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("list homes: %w", kvstore.Unavailable(err))
	}
	alive := map[string]bool{}
	for _, n := range live {
		alive[n.Name] = true
	}
	var away []string
	for _, kv := range resp.Kvs {
		if h, ok := decodeHome(kv); ok && h.Node != "" && !alive[h.Node] && !slices.Contains(away, h.Node) {
			away = append(away, h.Node)
		}
	}
	slices.Sort(away)
	return away, nil
}

// liveNodes reads the live node records and the revision they were read
// at, for a compare that no node record changed since.
func (s *Store) liveNodes(ctx context.Context) ([]NodeRecord, int64, error) {
	vs, rev, err := kvstore.ListJSON[NodeRecord](ctx, s.kv, nodesPrefix())
	if err != nil {
		return nil, 0, fmt.Errorf("list node records: %w", err)
	}
	out := make([]NodeRecord, len(vs))
	for i, v := range vs {
		out[i] = v.Value
	}
	return out, rev, nil
}

// RaiseSchema raises the cluster's level to the lowest level of the live
// nodes, if that is above it and no downgrade holds it, in one
// compare-and-swap with the node records read: a node that joined or
// changed meanwhile fails it, and it is tried again. by and version name
// the writer. want is the level the caller's view of the nodes expects:
// if the stored level is already there (another agent raised it), or a
// downgrade holds it, the node records are not read at all, so that a
// fleet that sees its last node upgraded does not list every node record
// once per agent. It returns the setting as it now is.
func (s *Store) RaiseSchema(ctx context.Context, want schema.Level, by, version string) (SchemaSetting, bool, error) {
	var out SchemaSetting
	var raised bool
	err := retry.Do(ctx, retry.Policy{}, func(ctx context.Context) error {
		cur, err := s.ReadSchema(ctx)
		if err != nil {
			return err
		}
		if cur.Level >= want || cur.Downgrade {
			out, raised = cur, false
			return nil
		}
		nodes, rev, err := s.liveNodes(ctx)
		if err != nil {
			return err
		}
		levels := make([]schema.Level, len(nodes))
		for i, n := range nodes {
			levels[i] = NodeLevel(n)
		}
		to, ok := schema.RaiseTo(cur.Level, cur.Downgrade, levels)
		if !ok {
			out, raised = cur, false
			return nil
		}
		away, err := s.awayNodes(ctx, nodes)
		if err != nil {
			return err
		}
		if len(away) > 0 {
			out, raised = cur, false
			return fmt.Errorf("%w: level %d waits for %s, which hold blocks or borrowed addresses and have no live record (their version is unknown): "+
				"bring them back, or free what they held with kvipamctl node remove", ErrNodesAway, to, strings.Join(away, ", "))
		}
		next := rewritten(cur, to, false, by, version, s.now().UTC())
		if err := s.putSetting(ctx, &next, settingUnchanged(cur), clientv3.Compare(clientv3.ModRevision(nodesPrefix()), "<", rev+1).WithPrefix()); err != nil {
			return err
		}
		out, raised = next, true
		return nil
	})
	return out, raised, err
}

// putSetting writes next if every compare holds, and sets its Rev.
func (s *Store) putSetting(ctx context.Context, next *SchemaSetting, cmps ...clientv3.Cmp) error {
	val, err := kvstore.EncodeJSON(next)
	if err != nil {
		return err
	}
	resp, err := s.kv.Txn(ctx).If(cmps...).Then(clientv3.OpPut(SchemaKey(), val)).Commit()
	if err != nil {
		return fmt.Errorf("write the schema level: %w", kvstore.Unavailable(err))
	}
	if !resp.Succeeded {
		return fmt.Errorf("write the schema level: it or what it rests on changed: %w", retry.ErrConflict)
	}
	next.Rev = resp.Header.Revision
	return nil
}

// LevelInUse is what keeps the cluster's level from going below Needs:
// a record that uses a feature of that level.
type LevelInUse struct {
	What  string // "pool p1"
	Uses  string // the feature
	Needs schema.Level
}

func (u LevelInUse) String() string {
	return fmt.Sprintf("%s uses %s (level %d)", u.What, u.Uses, u.Needs)
}

// levelsInUse lists the records that need a level above to, and the
// revision of the pools read, for a compare that none changed since.
func (s *Store) levelsInUse(ctx context.Context, to schema.Level) ([]LevelInUse, int64, error) {
	resp, err := s.kv.Txn(ctx).Then(clientv3.OpGet(PoolsPrefix(), clientv3.WithPrefix()), clientv3.OpGet(allStickyPrefix(), clientv3.WithPrefix()),
		clientv3.OpGet(AllImportMarksPrefix(), clientv3.WithPrefix())).Commit()
	if err != nil {
		return nil, 0, fmt.Errorf("list pools and sticky bindings: %w", kvstore.Unavailable(err))
	}
	var out []LevelInUse
	for _, kv := range resp.Responses[0].GetResponseRange().Kvs {
		v, err := kvstore.Decode[allocator.Pool](kv)
		if err != nil {
			return nil, 0, err
		}
		if need := schema.PoolNeeds(v.Value); need > to {
			out = append(out, LevelInUse{What: "pool " + v.Value.Name, Uses: schema.PoolMaxBlocks, Needs: need})
		}
	}
	if need := schema.MigrationNeeds(); need > to {
		for _, kv := range resp.Responses[1].GetResponseRange().Kvs {
			v, err := kvstore.Decode[records.Binding](kv)
			if err == nil && v.Value.Alternate != nil {
				out = append(out, LevelInUse{What: "the live migration of " + v.Value.Identity, Uses: schema.MigrationOwner, Needs: need})
			}
		}
	}
	if need := schema.ImportNeeds(); need > to {
		seen := map[string]bool{}
		for _, kv := range resp.Responses[2].GetResponseRange().Kvs {
			v, err := kvstore.Decode[records.ImportMark](kv)
			if err == nil && !seen[v.Value.Source] {
				seen[v.Value.Source] = true
				out = append(out, LevelInUse{What: "the import of " + v.Value.Source + " (not finalized)", Uses: schema.Import, Needs: need})
			}
		}
	}
	return out, resp.Header.Revision, nil
}

// ValidateDowngrade lists what keeps the cluster from going down to
// level to: the records in use that need a higher one. An empty list:
// EnableDowngrade would succeed now.
func (s *Store) ValidateDowngrade(ctx context.Context, to schema.Level) ([]LevelInUse, error) {
	cur, err := s.ReadSchema(ctx)
	if err != nil {
		return nil, err
	}
	if to > cur.Level {
		return nil, fmt.Errorf("%w: the cluster runs at level %d, below %d: nothing to lower", ErrSchemaLevel, cur.Level, to)
	}
	inUse, _, err := s.levelsInUse(ctx, to)
	return inUse, err
}

// EnableDowngrade lowers the cluster's level to to and holds it there:
// the agents stop raising it, and no write needing a higher level is
// accepted, so agents of a release that understands only to can be
// started. It is refused (ErrSchemaLevel, naming them) while a record
// needs a higher level, and the check and the write are one transaction
// over the pools read.
func (s *Store) EnableDowngrade(ctx context.Context, to schema.Level, version string) (SchemaSetting, error) {
	var out SchemaSetting
	err := retry.Do(ctx, retry.Policy{}, func(ctx context.Context) error {
		cur, err := s.ReadSchema(ctx)
		if err != nil {
			return err
		}
		if to > cur.Level {
			return fmt.Errorf("%w: the cluster runs at level %d, below %d: nothing to lower", ErrSchemaLevel, cur.Level, to)
		}
		inUse, rev, err := s.levelsInUse(ctx, to)
		if err != nil {
			return err
		}
		if len(inUse) > 0 {
			return downgradeRefused(to, inUse)
		}
		next := rewritten(cur, to, true, "kvipamctl", version, s.now().UTC())
		if err := s.putSetting(ctx, &next, settingUnchanged(cur), clientv3.Compare(clientv3.ModRevision(PoolsPrefix()), "<", rev+1).WithPrefix(),
			clientv3.Compare(clientv3.ModRevision(allStickyPrefix()), "<", rev+1).WithPrefix()); err != nil {
			return err
		}
		out = next
		return nil
	})
	return out, err
}

func downgradeRefused(to schema.Level, inUse []LevelInUse) error {
	names := make([]string, len(inUse))
	for i, u := range inUse {
		names[i] = u.String()
	}
	return fmt.Errorf("%w: cannot go down to level %d while records need more: %s (clear them first: kvipamctl pool set-max-blocks POOL none; let live migrations end)",
		ErrSchemaLevel, to, strings.Join(names, "; "))
}

// CancelDowngrade lets the level go: the agents raise it again once every
// live node understands the next. It is a no-op (changed false) when no
// downgrade holds it.
func (s *Store) CancelDowngrade(ctx context.Context, version string) (SchemaSetting, bool, error) {
	var out SchemaSetting
	var changed bool
	err := retry.Do(ctx, retry.Policy{}, func(ctx context.Context) error {
		cur, err := s.ReadSchema(ctx)
		if err != nil {
			return err
		}
		if !cur.Downgrade {
			out, changed = cur, false
			return nil
		}
		next := rewritten(cur, cur.Level, false, "kvipamctl", version, s.now().UTC())
		if err := s.putSetting(ctx, &next, settingUnchanged(cur)); err != nil {
			return err
		}
		out, changed = next, true
		return nil
	})
	return out, changed, err
}

// poolGate is the compares that fence a write of pool p by the schema
// level it needs: none for a pool of the base level; otherwise the
// cluster's level must include it and so must every live node's, and
// neither may change before the write lands. It is refused
// (ErrSchemaLevel, naming the nodes) while they do not.
func (s *Store) poolGate(ctx context.Context, p allocator.Pool) ([]clientv3.Cmp, error) {
	need := schema.PoolNeeds(p)
	if need <= schema.Base {
		return nil, nil
	}
	cur, err := s.ReadSchema(ctx)
	if err != nil {
		return nil, err
	}
	nodes, rev, err := s.liveNodes(ctx)
	if err != nil {
		return nil, err
	}
	var behind []string
	for _, n := range nodes {
		if l := NodeLevel(n); l < need {
			behind = append(behind, fmt.Sprintf("%s (%s, level %d)", n.Name, cmpVersion(n.Version), l))
		}
	}
	switch {
	case len(behind) > 0:
		return nil, fmt.Errorf("%w: pool %s uses %s, which needs level %d, and these live nodes do not understand it: %s (upgrade them first)",
			ErrSchemaLevel, p.Name, schema.PoolMaxBlocks, need, strings.Join(behind, ", "))
	case cur.Level < need:
		why := "the agents have not raised it yet"
		if away, err := s.awayNodes(ctx, nodes); err == nil && len(away) > 0 {
			why = fmt.Sprintf("it waits for %s, which hold blocks but have no live record (their version is unknown): bring them back, or kvipamctl node remove them", strings.Join(away, ", "))
		}
		if cur.Downgrade {
			why = "a downgrade holds it (kvipamctl downgrade cancel)"
		}
		return nil, fmt.Errorf("%w: pool %s uses %s, which needs level %d, and the cluster runs at level %d: %s",
			ErrSchemaLevel, p.Name, schema.PoolMaxBlocks, need, cur.Level, why)
	}
	return []clientv3.Cmp{settingUnchanged(cur), clientv3.Compare(clientv3.ModRevision(nodesPrefix()), "<", rev+1).WithPrefix()}, nil
}

// cmpVersion is a node's version for messages.
func cmpVersion(v string) string {
	if v == "" {
		return "version unknown"
	}
	return v
}

// WatchSchema follows the schema key as WatchNodes follows the node
// records: Reset with the setting (or none), Put on a change.
func (s *Store) WatchSchema(ctx context.Context, h Handler[SchemaSetting]) error {
	key := SchemaKey()
	return s.follow(ctx, key, decoded[SchemaSetting]{h: h,
		decode: func(kv *mvccpb.KeyValue) (SchemaSetting, bool) {
			v, err := kvstore.Decode[SchemaSetting](kv)
			v.Value.Rev = kv.ModRevision
			return v.Value, err == nil && string(kv.Key) == key
		},
		fromKey: func(k string) (SchemaSetting, bool) { return SchemaSetting{Level: schema.Base}, k == key },
	})
}
