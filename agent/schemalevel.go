package agent

import (
	"context"
	"errors"
	"fmt"
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
// understands the next one (etcdstore.RaiseSchema): it tries at start and
// whenever a node record or the level changes.
type schemaRaiser struct {
	store interface {
		RaiseSchema(ctx context.Context, by, version string) (etcdstore.SchemaSetting, bool, error)
		WatchNodes(ctx context.Context, h etcdstore.Handler[etcdstore.NodeInfo]) error
		WatchSchema(ctx context.Context, h etcdstore.Handler[etcdstore.SchemaSetting]) error
	}
	node, version string
	log           hclog.Logger
}

func (r schemaRaiser) run(ctx context.Context) {
	poke := make(chan struct{}, 1)
	go func() { _ = r.store.WatchNodes(ctx, poker[etcdstore.NodeInfo](poke)) }()
	go func() { _ = r.store.WatchSchema(ctx, poker[etcdstore.SchemaSetting](poke)) }()
	for {
		select {
		case <-ctx.Done():
			return
		case <-poke:
		}
		cur, raised, err := r.store.RaiseSchema(ctx, r.node, r.version)
		switch {
		case err != nil && ctx.Err() == nil:
			// The next change of a node record or of the level tries again.
			r.log.Warn("could not raise the schema level", "error", err)
		case raised:
			r.log.Info("raised the cluster's schema level: every live node understands it", "level", cur.Level)
		}
	}
}

// poker is a watch handler that only says something changed.
type poker[T any] chan struct{}

func (p poker[T]) poke() {
	select {
	case p <- struct{}{}:
	default:
	}
}
func (p poker[T]) Reset([]T) { p.poke() }
func (p poker[T]) Put(T)     { p.poke() }
func (p poker[T]) Delete(T)  { p.poke() }
