package main

import (
	"os"
	"reflect"
	"sort"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"sigs.k8s.io/yaml"

	"github.com/kvipam/kvipam/agent"
	"github.com/kvipam/kvipam/internal/foundation/configfile"
)

// TestAgentConfigExampleComplete: deploy/config/agent.yaml, the example
// docs/agent.md points to, shows every key of the file with a value of
// its type. A key that is an alternative to one in force (etcd.embedded
// beside etcd.endpoints) or that would change the example's meaning is
// written commented out, as "#~ key: value"; with those lines taken in,
// the file still decodes strictly, so every example value is one the
// agent reads.
func TestAgentConfigExampleComplete(t *testing.T) {
	data, err := os.ReadFile("../../deploy/config/agent.yaml")
	require.NoError(t, err)
	var lines []string
	for _, l := range strings.Split(string(data), "\n") {
		if i := strings.Index(l, "#~ "); i >= 0 && strings.TrimSpace(l[:i]) == "" {
			l = l[:i] + l[i+len("#~ "):]
		}
		lines = append(lines, l)
	}
	full := []byte(strings.Join(lines, "\n"))
	var c agent.Config
	require.NoError(t, configfile.Unmarshal(full, &c), "the example with its commented keys decodes strictly")

	var doc any
	require.NoError(t, yaml.Unmarshal(full, &doc))
	shown := map[string]bool{}
	walkKeys(doc, "", shown)
	var missing []string
	for _, k := range configfile.Keys(reflect.TypeFor[agent.Config]()) {
		if k.Type.Name() == "movedToPool" || k.Path == "pools[].maxBlocksPerNode" {
			continue // a refused key (reuseCooldown, maxBlocksPerNode) has no example
		}
		if !shown[k.Path] {
			missing = append(missing, k.Path)
		}
	}
	sort.Strings(missing)
	require.Empty(t, missing, "deploy/config/agent.yaml shows no example of these keys")
}

// walkKeys records in shown the path of every key of doc, as
// configfile.Keys writes them (a.b, list[].c).
func walkKeys(doc any, path string, shown map[string]bool) {
	switch v := doc.(type) {
	case map[string]any:
		for k, x := range v {
			p := k
			if path != "" {
				p = path + "." + k
			}
			shown[p] = true
			walkKeys(x, p, shown)
		}
	case []any:
		for _, x := range v {
			walkKeys(x, path+"[]", shown)
		}
	}
}
