// Package schema names what kvipam writes in etcd, version by version, as
// levels of features, and decides with pure functions which level a
// cluster of mixed agents may use.
//
// Level 1 is everything kvipam v0.1.0 writes. A later level adds features:
// a new record field, key kind or encoding that an agent of an earlier
// level would misread, ignore or drop. An agent advertises the features
// it understands in its node record; the cluster's level, stored in etcd
// (etcdstore.SchemaSetting), is raised by the agents once every live node
// understands the next level, and a record that needs a feature is
// written only while the level includes it. An agent whose highest level
// is below the stored one refuses to start, and an operator lowers the
// level before a downgrade (kvipamctl downgrade), which is refused while a
// record in use needs the level. The model is etcd's own cluster version
// and `etcdctl downgrade`.
package schema

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
)

// Level is a schema level: 1 is v0.1.0's, and each later level includes
// the features of every level below it.
type Level int

// Base is the level of a node that names no features: v0.1.0, which
// predates levels, and the level of a cluster with no stored setting.
const Base Level = 1

// Feature is one change to what is written in etcd.
type Feature struct {
	// Name is how node records and kvipamctl name it.
	Name string
	// Level is the level that introduces it.
	Level Level
	// Since is the first release that understands it.
	Since string
	// What says what it writes, for kvipamctl version.
	What string
}

// PoolMaxBlocks is the pool spec field maxBlocksPerNode: a node claims at
// most that many blocks of a family in the pool and borrows beyond them.
// An agent that does not know the field would claim past the limit.
const PoolMaxBlocks = "pool-max-blocks"

// MigrationOwner is an address's second, non-forwarding owner during a
// live migration (records.Alternate, in the sticky binding and in each
// address's record). An agent that does not know it would release the
// addresses at the source pod's DEL while the target pod runs on them.
const MigrationOwner = "migration-owner"

// Import is an import mark (kvipamctl import): what an import wrote for
// a node, which the node's agent watches to hold the imported blocks and
// addresses as its own. An agent that does not know it would not learn
// them: the old pods' DELs would find nothing to free.
const Import = "import"

// features are every feature this binary understands, by level.
var features = []Feature{
	{Name: PoolMaxBlocks, Level: 2, Since: "v0.2.0", What: "pool spec field maxBlocksPerNode (kvipamctl pool set-max-blocks)"},
	{Name: MigrationOwner, Level: 3, Since: "v0.2.0", What: "a live migration's second owner of a sticky identity's addresses (alternate, in bindings and address records)"},
	{Name: Import, Level: 4, Since: "v0.2.0", What: "import marks of kvipamctl import, which the node's agent learns imported blocks and addresses from"},
}

// releases maps each release to the highest level it understands
// (RELEASES, docs/releasing.md). A release not listed here understands
// the level of the newest release before it.
var releases = []struct {
	version string
	level   Level
}{
	{"v0.1.0", 1},
}

// Features returns every feature this binary understands, oldest first.
func Features() []Feature { return slices.Clone(features) }

// Highest is the highest level this binary understands.
func Highest() Level {
	l := Base
	for _, f := range features {
		l = max(l, f.Level)
	}
	return l
}

// Names returns the names of the features this binary understands, as
// its node record advertises them.
func Names() []string {
	out := make([]string, len(features))
	for i, f := range features {
		out[i] = f.Name
	}
	return out
}

// LevelOf is the highest level whose features (and every lower level's)
// names all include: the level of a node that advertises names. A node
// that advertises nothing (v0.1.0) is at Base. Features this binary does
// not know cannot raise the level past Highest: a newer node's extra
// features only say it is newer.
func LevelOf(names []string) Level {
	l := Base
	for next := Base + 1; next <= Highest(); next++ {
		for _, f := range features {
			if f.Level == next && !slices.Contains(names, f.Name) {
				return l
			}
		}
		l = next
	}
	return l
}

// Enabled reports whether feature is in use at level l.
func Enabled(feature string, l Level) bool {
	for _, f := range features {
		if f.Name == feature {
			return l >= f.Level
		}
	}
	return false
}

// FeaturesAbove names the features of levels above l, for messages.
func FeaturesAbove(l Level) []string {
	var out []string
	for _, f := range features {
		if f.Level > l {
			out = append(out, f.Name)
		}
	}
	return out
}

// ParseTarget reads the level an operator names for a downgrade: a
// release (v0.1.0), whose level is the newest listed at or before it, or
// a level ("1", "level-1").
func ParseTarget(s string) (Level, error) {
	if n, ok := strings.CutPrefix(s, "level-"); ok {
		s = n
	}
	if n, err := strconv.Atoi(s); err == nil {
		if n < int(Base) || Level(n) > Highest() {
			return 0, fmt.Errorf("level %d: levels run from %d to %d", n, Base, Highest())
		}
		return Level(n), nil
	}
	v, ok := parseVersion(s)
	if !ok {
		return 0, fmt.Errorf("%q is neither a release (v0.1.0) nor a level (1)", s)
	}
	first, _ := parseVersion(releases[0].version)
	if compareVersions(v, first) < 0 {
		return 0, fmt.Errorf("%s predates kvipam's first release %s", s, releases[0].version)
	}
	l := Base
	for _, r := range releases {
		rv, _ := parseVersion(r.version)
		if compareVersions(rv, v) <= 0 {
			l = r.level
		}
	}
	if newest, _ := parseVersion(releases[len(releases)-1].version); compareVersions(v, newest) > 0 && (v[0] != newest[0] || v[1] != newest[1]) {
		// A minor release after the newest this binary knows is this
		// binary's own or a later one: it understands what this one
		// does. A patch release writes what its minor does
		// (docs/releasing.md: a change to etcd's records is minor).
		l = Highest()
	}
	return l, nil
}

// parseVersion reads vMAJOR.MINOR.PATCH (a -rc.N or -dev suffix is the
// same release line: a candidate understands what its release does).
func parseVersion(s string) ([3]int, bool) {
	var v [3]int
	rest, ok := strings.CutPrefix(s, "v")
	if !ok {
		return v, false
	}
	if i := strings.IndexAny(rest, "-+"); i >= 0 {
		rest = rest[:i]
	}
	parts := strings.Split(rest, ".")
	if len(parts) != 3 {
		return v, false
	}
	for i, p := range parts {
		n, err := strconv.Atoi(p)
		if err != nil || n < 0 {
			return v, false
		}
		v[i] = n
	}
	return v, true
}

func compareVersions(a, b [3]int) int {
	for i := range a {
		if a[i] != b[i] {
			return a[i] - b[i]
		}
	}
	return 0
}
