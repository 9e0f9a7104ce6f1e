package k8s

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// releaseImage is a recorded release's image archive and rendered
// manifests (make image VERSION=... in a worktree at the release's
// commit, one architecture: the nodes are this machine).
type releaseImage struct {
	version   string
	tar       string // kvipam-image.tar
	agentYAML string // kvipam-agent.yaml, its image set to ref
	ref       string // ghcr.io/kvipam/kvipam:VERSION
}

// buildRelease builds version's image from git as the release's own
// Makefile makes it, like internal/testsupport/releasetest.Build does its
// binaries (this module cannot import kvipam's packages). The archive is
// cached under the repository's .cache/release-image/COMMIT/, so a second
// run does not rebuild it: a commit's image never changes.
func (c *kcluster) buildRelease(tb testing.TB, version string) releaseImage {
	tb.Helper()
	commit, err := releaseCommit(c.repo, version)
	require.NoError(tb, err)
	cache := filepath.Join(c.repo, ".cache", "release-image", commit)
	r := releaseImage{version: version, tar: filepath.Join(cache, "kvipam-image.tar"),
		agentYAML: filepath.Join(cache, "kvipam-agent.yaml"), ref: "ghcr.io/kvipam/kvipam:" + version}
	if _, err := os.Stat(r.tar); err == nil {
		logf("release %s's image: cached in %s", version, cache)
		return r
	}
	if err := exec.Command("git", "-C", c.repo, "cat-file", "-e", commit+"^{commit}").Run(); err != nil {
		tb.Fatalf("release %s: commit %s is not in this clone (a shallow one? git fetch --unshallow)", version, commit)
	}
	wt := filepath.Join(c.dir, "release-"+version)
	_, err = run("git", "-C", c.repo, "worktree", "add", "--detach", wt, commit)
	require.NoError(tb, err)
	defer func() {
		if _, err := run("git", "-C", c.repo, "worktree", "remove", "--force", wt); err != nil {
			logf("%v", err)
		}
	}()
	// Built beside the cache and renamed into it: an interrupted build
	// leaves no half archive that a later run would take.
	require.NoError(tb, os.MkdirAll(filepath.Dir(cache), 0o755))
	tmp, err := os.MkdirTemp(filepath.Dir(cache), commit+".tmp-")
	require.NoError(tb, err)
	defer os.RemoveAll(tmp)
	cmd := exec.Command("make", "--no-print-directory", "-C", wt, "image", "VERSION="+version, "BIN="+tmp, "IMAGE_ARCHS=amd64")
	cmd.Env = cleanMakeEnv()
	if out, err := cmd.CombinedOutput(); err != nil {
		tb.Fatalf("make image VERSION=%s at %s: %v\n%s", version, commit, err, tail(string(out), 3000))
	}
	require.NoError(tb, os.Rename(tmp, cache))
	logf("release %s's image built from %s into %s", version, commit, cache)
	return r
}

var releaseLine = regexp.MustCompile(`^(v\S+)\s+([0-9a-f]{40})$`)

// releaseCommit is version's commit in the repository's RELEASES.
func releaseCommit(repo, version string) (string, error) {
	f, err := os.Open(filepath.Join(repo, "RELEASES"))
	if err != nil {
		return "", err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if m := releaseLine.FindStringSubmatch(strings.TrimSpace(sc.Text())); m != nil && m[1] == version {
			return m[2], nil
		}
	}
	if err := sc.Err(); err != nil {
		return "", err
	}
	return "", fmt.Errorf("%s is not in RELEASES", version)
}

// cleanMakeEnv is the environment without an enclosing make's variables
// (make k8s-e2e runs go test: its MAKEFLAGS would carry VERSION=... into
// the release's make).
func cleanMakeEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		switch strings.SplitN(kv, "=", 2)[0] {
		case "MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "VERSION", "COMMIT", "LDFLAGS", "BIN", "IMAGE", "IMAGE_ARCHS":
			continue
		}
		env = append(env, kv)
	}
	return env
}

// importImage puts an image archive into each node's containerd (the
// manifests say imagePullPolicy IfNotPresent: nothing is pulled).
func (c *kcluster) importImage(tb testing.TB, tar string) {
	tb.Helper()
	for _, n := range c.nodes {
		_, err := run("ctr", "--address", n.socket, "-n", "k8s.io", "images", "import", "--snapshotter", "native", "--all-platforms", tar)
		require.NoError(tb, err)
	}
}

// imageRef is the kvipam image a rendered manifest names.
func imageRef(manifest string) (string, error) {
	b, err := os.ReadFile(manifest)
	if err != nil {
		return "", err
	}
	m := regexp.MustCompile(`(?m)^\s+image: (ghcr\.io/kvipam/kvipam:\S+)$`).FindStringSubmatch(string(b))
	if m == nil {
		return "", fmt.Errorf("%s names no kvipam image", manifest)
	}
	return m[1], nil
}
