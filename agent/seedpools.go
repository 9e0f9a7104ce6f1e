package agent

import (
	"context"
	"errors"
	"fmt"

	"github.com/hashicorp/go-hclog"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
)

// poolSeeder creates a pool in etcd if etcd lacks it (etcdstore.Store).
type poolSeeder interface {
	SeedPool(ctx context.Context, p allocator.Pool) (stored allocator.Pool, created bool, err error)
}

// seedPools creates each configured pool that etcd lacks. Pools live in
// etcd (invariant 8): a configured pool that etcd already has changes
// nothing there, and a difference (an operator added or removed a cidr,
// reserved a range, disabled it, gave it a selector, a reuse cooldown or a masquerade setting)
// is logged once as a warning. Nothing here stops the agent: a pool that
// cannot be seeded (it overlaps another, etcd did not answer) is logged,
// and the agent serves what etcd holds.
func seedPools(ctx context.Context, st poolSeeder, pools []allocator.Pool, log hclog.Logger) {
	for _, p := range pools {
		stored, created, err := st.SeedPool(ctx, p)
		switch {
		case errors.Is(err, etcdstore.ErrPoolDeleted):
			log.Warn("a configured pool was deleted by an operator; it is not created again", "pool", p.Name, "reason", err)
		case err != nil:
			log.Error("could not seed a configured pool in etcd; serving what etcd holds", "pool", p.Name, "error", err)
		case created:
			log.Info("created a configured pool in etcd", "pool", p.Name, "cidrs", p.CIDRs, "node_selector", p.NodeSelector)
		case !allocator.SameSpec(seedView(stored, p), p):
			log.Warn("configured pool differs from etcd's; etcd's spec is served and the configuration changes nothing (kvipamctl pool show)",
				"pool", p.Name, "etcd", describePool(stored), "configured", describePool(p))
		}
	}
}

// seedView is stored as a configuration could spell it: what a
// configuration never says (disabled) does not count as a difference.
func seedView(stored, p allocator.Pool) allocator.Pool {
	stored.Disabled = p.Disabled
	return stored
}

func describePool(p allocator.Pool) string {
	s := fmt.Sprintf("cidrs %v, blocks /%d /%d, %d reserved ranges", p.CIDRs, p.BlockSizeV4, p.BlockSizeV6, len(p.Reserved))
	if p.NodeSelector != "" {
		s += ", node selector " + p.NodeSelector
	}
	if p.ReuseCooldown != nil {
		s += ", reuse cooldown " + p.ReuseCooldown.String()
	}
	if p.Masquerade != nil {
		s += ", masquerade " + p.MasqueradeSetting()
	}
	if p.Disabled {
		s += ", disabled"
	}
	return s
}
