package schema

import "github.com/kvipam/kvipam/allocator"

// PoolNeeds is the level a pool spec needs: the highest level of a
// feature it uses. A pool that uses none needs Base.
func PoolNeeds(p allocator.Pool) Level {
	if p.MaxBlocksPerNode > 0 {
		return levelOf(PoolMaxBlocks)
	}
	return Base
}

// levelOf is feature's level.
func levelOf(feature string) Level {
	for _, f := range features {
		if f.Name == feature {
			return f.Level
		}
	}
	return Base
}

// RaiseTo decides whether the agents may raise the cluster's stored
// level, given the levels of the live nodes: to the lowest of them, when
// that is above the stored level and no downgrade holds it. A cluster
// with no live node is not raised.
func RaiseTo(stored Level, downgrade bool, live []Level) (Level, bool) {
	if downgrade || len(live) == 0 {
		return stored, false
	}
	low := live[0]
	for _, l := range live[1:] {
		low = min(low, l)
	}
	return low, low > stored
}

// MigrationNeeds is the level a live migration's alternate owner needs.
func MigrationNeeds() Level { return levelOf(MigrationOwner) }

// ImportNeeds is the level an import (its marks) needs.
func ImportNeeds() Level { return levelOf(Import) }
