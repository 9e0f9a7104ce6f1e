package agent

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/hashicorp/go-hclog"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/schema"
	"github.com/kvipam/kvipam/internal/foundation/retry"
)

// schemaKnowledge is what this agent understands of the etcd schema:
// schema.Highest and schema.Names for a real agent. A test gives an
// agent less, to stand for an older release (Agent.knows).
type schemaKnowledge struct {
	highest  schema.Level
	features []string
}

// thisBinary is what this build understands.
func thisBinary() schemaKnowledge {
	return schemaKnowledge{highest: schema.Highest(), features: schema.Names()}
}

// schemaReader reads the cluster's schema level (etcdstore.Store).
type schemaReader interface {
	ReadSchema(ctx context.Context) (etcdstore.SchemaSetting, error)
}

// checkSchema refuses the start of an agent that does not understand the
// cluster's schema level, before it writes anything: a level raised by a
// newer release, or one an operator has not lowered for this downgrade.
// It waits for etcd while etcd does not answer.
func checkSchema(ctx context.Context, st schemaReader, knows schemaKnowledge, version string, log hclog.Logger) error {
	var cur etcdstore.SchemaSetting
	b := backoff.WithContext(backoff.NewExponentialBackOff(backoff.WithMaxElapsedTime(0), backoff.WithMaxInterval(5*time.Second)), ctx)
	err := backoff.Retry(func() error {
		var err error
		cur, err = st.ReadSchema(ctx)
		if errors.Is(err, retry.ErrUnavailable) {
			log.Warn("etcd does not answer; reading the schema level again", "error", err)
			return err
		}
		return backoff.Permanent(err)
	}, b)
	if err != nil {
		return fmt.Errorf("refusing to start: %w", err)
	}
	if cur.Level <= knows.highest {
		return nil
	}
	by := "an agent"
	if cur.By != "" {
		by = cur.By
	}
	newer := cur.Version
	if newer == "" {
		newer = "a newer kvipam"
	}
	return fmt.Errorf("refusing to start: %w: etcd's kvipam schema is at level %d (raised by %s running kvipam %s), "+
		"newer than this agent's kvipam %s, which understands levels up to %d: run kvipam %s or later here, "+
		"or, to run kvipam %s, first lower the cluster's level with kvipam %s's kvipamctl (kvipamctl downgrade enable %s); nothing was written",
		etcdstore.ErrSchemaLevel, cur.Level, by, newer, version, knows.highest, newer, version, newer, version)
}

// schemaRaiser raises the cluster's schema level once every live node
// understands the next one (etcdstore.RaiseSchema). It follows the node
// records and the level with two watches, and writes only when its view
// says a raise is due: the lowest live node's level above the stored one
// and no downgrade holding it.
type schemaRaiser struct {
	store interface {
		RaiseSchema(ctx context.Context, want schema.Level, by, version string) (etcdstore.SchemaSetting, bool, error)
		WatchNodes(ctx context.Context, h etcdstore.Handler[etcdstore.NodeInfo]) error
		WatchSchema(ctx context.Context, h etcdstore.Handler[etcdstore.SchemaSetting]) error
	}
	node, version string
	log           hclog.Logger
}

func (r schemaRaiser) run(ctx context.Context) {
	v := &schemaView{levels: map[string]schema.Level{}, poke: make(chan struct{}, 1)}
	go func() { _ = r.store.WatchNodes(ctx, nodeLevels{v}) }()
	go func() { _ = r.store.WatchSchema(ctx, storedLevel{v}) }()
	// A raise that waits for nodes away is tried again after awayRetry:
	// what frees it (kvipamctl node remove) changes no node record.
	var again <-chan time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-v.poke:
		case <-again:
		}
		again = nil
		want, due := v.due()
		if !due {
			continue
		}
		cur, raised, err := r.store.RaiseSchema(ctx, want, r.node, r.version)
		switch {
		case errors.Is(err, etcdstore.ErrNodesAway):
			r.log.Info("the schema level waits for nodes that are away", "level", want, "reason", err)
			again = time.After(awayRetry)
		case err != nil && ctx.Err() == nil:
			// The next change of a node record or of the level tries again.
			r.log.Warn("could not raise the schema level", "level", want, "error", err)
		case raised:
			r.log.Info("raised the cluster's schema level: every live node understands it", "level", cur.Level)
		}
	}
}

// awayRetry is how often a raise that waits for nodes away is tried.
const awayRetry = 30 * time.Second

// schemaView is what the raiser's watches saw: each live node's level
// and the stored setting. It is safe for concurrent use.
type schemaView struct {
	mu     sync.Mutex
	levels map[string]schema.Level
	stored *etcdstore.SchemaSetting
	poke   chan struct{}
}

func (v *schemaView) changed() {
	select {
	case v.poke <- struct{}{}:
	default:
	}
}

// due is the level a raise would reach, and whether one is due.
func (v *schemaView) due() (schema.Level, bool) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.stored == nil {
		return 0, false
	}
	live := make([]schema.Level, 0, len(v.levels))
	for _, l := range v.levels {
		live = append(live, l)
	}
	return schema.RaiseTo(v.stored.Level, v.stored.Downgrade, live)
}

// nodeLevels feeds the node records' levels to a schemaView.
type nodeLevels struct{ v *schemaView }

func (h nodeLevels) Reset(all []etcdstore.NodeInfo) {
	h.v.mu.Lock()
	clear(h.v.levels)
	for _, n := range all {
		h.v.levels[n.Name] = n.Level
	}
	h.v.mu.Unlock()
	h.v.changed()
}

func (h nodeLevels) Put(n etcdstore.NodeInfo) {
	h.v.mu.Lock()
	h.v.levels[n.Name] = n.Level
	h.v.mu.Unlock()
	h.v.changed()
}

func (h nodeLevels) Delete(n etcdstore.NodeInfo) {
	h.v.mu.Lock()
	delete(h.v.levels, n.Name)
	h.v.mu.Unlock()
	h.v.changed()
}

// storedLevel feeds the stored setting to a schemaView; a deleted key is
// level 1 again.
type storedLevel struct{ v *schemaView }

func (h storedLevel) Reset(all []etcdstore.SchemaSetting) {
	set := etcdstore.SchemaSetting{Level: schema.Base}
	if len(all) > 0 {
		set = all[0]
	}
	h.Put(set)
}

func (h storedLevel) Put(set etcdstore.SchemaSetting) {
	h.v.mu.Lock()
	h.v.stored = &set
	h.v.mu.Unlock()
	h.v.changed()
}

func (h storedLevel) Delete(etcdstore.SchemaSetting) {
	h.Put(etcdstore.SchemaSetting{Level: schema.Base})
}
