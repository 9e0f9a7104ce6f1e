package main

import (
	"errors"
	"flag"
	"os"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/agent"
	"github.com/kvipam/kvipam/internal/foundation/configfile"
)

// TestAgentConfigReferenceComplete: docs/agent.md's table of the file's
// keys names every key of agent.Config (found by reflection, at every
// depth, as the strict reader reads them) and no other, and every flag of
// the command is named in that part of the page, each flag of the table
// being one the command has.
func TestAgentConfigReferenceComplete(t *testing.T) {
	page, err := os.ReadFile("../../docs/agent.md")
	require.NoError(t, err)
	const heading = "### Every key of the file\n"
	text := string(page)
	i := strings.Index(text, heading)
	require.GreaterOrEqual(t, i, 0, "docs/agent.md has no %q", heading)
	section := text[i+len(heading):]
	if j := strings.Index(section, "\n## "); j >= 0 {
		section = section[:j]
	}

	var documented, tableFlags []string
	flagRE := regexp.MustCompile("`--([a-z0-9-]+)")
	for _, line := range strings.Split(section, "\n") {
		cells := strings.Split(line, "|")
		if len(cells) < 7 || !strings.HasPrefix(strings.TrimSpace(cells[1]), "`") {
			continue
		}
		documented = append(documented, strings.Trim(strings.TrimSpace(cells[1]), "`"))
		for _, m := range flagRE.FindAllStringSubmatch(cells[4], -1) {
			tableFlags = append(tableFlags, m[1])
		}
	}
	var keys []string
	for _, k := range configfile.Keys(reflect.TypeFor[agent.Config]()) {
		keys = append(keys, k.Path)
	}
	require.NotEmpty(t, documented, "the table was found")
	for _, k := range keys {
		require.Contains(t, documented, k, "docs/agent.md: key %s is missing from the table", k)
	}
	for _, k := range documented {
		require.Contains(t, keys, k, "docs/agent.md: the table names %s, which the configuration does not have", k)
	}
	require.Len(t, documented, len(keys), "each key once")

	_, err = loadConfig([]string{"-h"}, env(nil))
	require.True(t, errors.Is(err, flag.ErrHelp), "%v", err)
	var flags []string
	for _, m := range regexp.MustCompile(`(?m)^  -([a-z0-9-]+)`).FindAllStringSubmatch(err.Error(), -1) {
		flags = append(flags, m[1])
	}
	require.Contains(t, flags, "etcd-embedded", "the usage text was parsed")
	named := flagRE.FindAllStringSubmatch(section, -1)
	for _, f := range flags {
		require.True(t, slices.ContainsFunc(named, func(m []string) bool { return m[1] == f }), "docs/agent.md: flag --%s is not named with the keys", f)
	}
	for _, f := range tableFlags {
		require.Contains(t, flags, f, "docs/agent.md: the table names --%s, which the command does not have", f)
	}
}
