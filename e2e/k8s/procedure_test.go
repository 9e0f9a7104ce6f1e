package k8s

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// procedure is a section of a doc's shell blocks, each named by its
// first line (a comment): the commands an operator types, which a test
// runs as written.
type procedure struct {
	doc, section string
	blocks       map[string]string // first comment line, without "# " -> the block
}

// readProcedure reads the ```sh blocks of section (a "## " heading, up to
// the next one) of doc, relative to the repository.
func (c *kcluster) readProcedure(tb testing.TB, doc, section string) procedure {
	tb.Helper()
	f, err := os.Open(filepath.Join(c.repo, doc))
	require.NoError(tb, err)
	defer f.Close()
	p := procedure{doc: doc, section: section, blocks: map[string]string{}}
	var in, inBlock bool
	var block []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		trimmed := strings.TrimSpace(line)
		switch {
		case strings.HasPrefix(line, "## "):
			in = line == "## "+section
		case !in:
		case !inBlock && trimmed == "```sh":
			inBlock, block = true, nil
		case inBlock && trimmed == "```":
			inBlock = false
			require.NotEmpty(tb, block, "%s, %q: an empty sh block", doc, section)
			name, ok := strings.CutPrefix(block[0], "# ")
			require.True(tb, ok, "%s, %q: a sh block's first line names it as a comment: %q", doc, section, block[0])
			require.NotContains(tb, p.blocks, name, "%s, %q: two sh blocks named %q", doc, section, name)
			p.blocks[name] = strings.Join(block, "\n") + "\n"
		case inBlock:
			block = append(block, trimmed)
		}
	}
	require.NoError(tb, sc.Err())
	require.NotEmpty(tb, p.blocks, "%s has a section %q with sh blocks", doc, section)
	return p
}

// run runs the block named name with sh -e (a failing command fails the
// step) and env's variables, kubectl and kvipamctl on PATH being the test
// cluster's (as the admin, and with kvipam's etcd certificate); it
// returns the block's output.
func (p procedure) run(tb testing.TB, c *kcluster, name string, env ...string) string {
	tb.Helper()
	block, ok := p.blocks[name]
	require.True(tb, ok, "%s, %q has a sh block named %q", p.doc, p.section, name)
	cmd := exec.Command("sh", "-e", "-c", block)
	cmd.Env = append(os.Environ(), "PATH="+c.operatorPath(tb)+":"+os.Getenv("PATH"))
	cmd.Env = append(cmd.Env, env...)
	out, err := cmd.CombinedOutput()
	logf("%s (%s):\n%s%s", name, strings.Join(env, " "), block, indent(string(out)))
	require.NoError(tb, err, "%s, %q, the block %q (%s) as written:\n%s", p.doc, p.section, name, strings.Join(env, " "), out)
	return string(out)
}

func indent(s string) string {
	if s == "" {
		return ""
	}
	return "  | " + strings.ReplaceAll(strings.TrimRight(s, "\n"), "\n", "\n  | ") + "\n"
}

// operatorPath is a directory holding kubectl and kvipamctl as an
// operator has them: the cluster's admin, and kvipamctl with etcd's
// endpoints and kvipam's certificate (both in the router's network
// namespace, where the API server and etcd listen).
func (c *kcluster) operatorPath(tb testing.TB) string {
	tb.Helper()
	dir := filepath.Join(c.dir, "operator")
	if _, err := os.Stat(filepath.Join(dir, "kvipamctl")); err == nil {
		return dir
	}
	require.NoError(tb, os.MkdirAll(dir, 0o755))
	p := func(n string) string { return filepath.Join(c.pki, n) }
	ns := "nsenter --net=/run/netns/" + c.router + " --"
	scripts := map[string]string{
		"kubectl": fmt.Sprintf("#!/bin/sh\nexec %s %s --kubeconfig %s \"$@\"\n", ns, filepath.Join(c.kbin, "kubectl"), c.kubecfg),
		"kvipamctl": fmt.Sprintf("#!/bin/sh\nexec %s %s --endpoints %s --cacert %s --cert %s --key %s --timeout 60s \"$@\"\n",
			ns, filepath.Join(c.bin, "kvipamctl"), etcdURL, p("ca.crt"), p("kvipam.crt"), p("kvipam.key")),
	}
	for name, s := range scripts {
		require.NoError(tb, os.WriteFile(filepath.Join(dir, name), []byte(s), 0o755))
	}
	return dir
}
