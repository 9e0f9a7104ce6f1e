// Package releasetest builds kvipam's recorded releases from git, for
// tests that run an old version beside the current one (an upgrade, a
// mixed cluster, a schema read by both). The releases are listed in the
// repository's RELEASES file, one "vX.Y.Z <commit>" a line
// (docs/releasing.md); there are no git tags, so the version is passed to
// the build rather than read from git describe.
//
// Build(t, "v0.1.0") checks the release's commit out into a temporary
// worktree (git worktree add --detach), runs make build there with
// VERSION=v0.1.0, and returns that worktree's bin directory; the worktree
// is removed when the test ends.
package releasetest

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// File is the list of releases, at the repository's root.
const File = "RELEASES"

// Release is one line of RELEASES.
type Release struct {
	Version string // vMAJOR.MINOR.PATCH or vMAJOR.MINOR.PATCH-rc.N
	Commit  string // the full commit it was built from (40 hex digits)
}

// The version scheme make release accepts (scripts/release.sh).
var (
	semver  = regexp.MustCompile(`^v(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)(-rc\.(0|[1-9][0-9]*))?$`)
	fullSHA = regexp.MustCompile(`^[0-9a-f]{40}$`)
)

// ValidVersion reports whether v is a version make release accepts.
func ValidVersion(v string) bool { return semver.MatchString(v) }

// RepoRoot is the directory holding kvipam's go.mod, found from the
// working directory up (a test runs in its package's directory).
func RepoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if b, err := os.ReadFile(filepath.Join(dir, "go.mod")); err == nil && strings.HasPrefix(string(b), "module github.com/kvipam/kvipam\n") {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("no kvipam go.mod above the working directory")
		}
		dir = parent
	}
}

// Read parses RELEASES in root: blank lines and # comments are skipped;
// every other line is a valid version and a full commit, each version
// once.
func Read(root string) ([]Release, error) {
	f, err := os.Open(filepath.Join(root, File))
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var rs []Release
	seen := map[string]bool{}
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		fields := strings.Fields(line)
		if len(fields) != 2 || !ValidVersion(fields[0]) || !fullSHA.MatchString(fields[1]) {
			return nil, fmt.Errorf("%s:%d: %q is not \"vMAJOR.MINOR.PATCH[-rc.N] <40-hex commit>\"", File, n, line)
		}
		if seen[fields[0]] {
			return nil, fmt.Errorf("%s:%d: %s is listed twice", File, n, fields[0])
		}
		seen[fields[0]] = true
		rs = append(rs, Release{Version: fields[0], Commit: fields[1]})
	}
	return rs, sc.Err()
}

// Lookup is the release called version in root's RELEASES.
func Lookup(root, version string) (Release, error) {
	rs, err := Read(root)
	if err != nil {
		return Release{}, err
	}
	for _, r := range rs {
		if r.Version == version {
			return r, nil
		}
	}
	return Release{}, fmt.Errorf("%s is not in %s", version, File)
}

// Build builds the recorded release version with its own Makefile (make
// build VERSION=version in a detached worktree at its commit) and returns
// the directory holding its binaries, removed when the test ends. It
// skips the test when git or make is missing, and fails it when the
// commit is not in this clone (a shallow one: git fetch --unshallow).
func Build(t testing.TB, version string) (binDir string) {
	t.Helper()
	for _, tool := range []string{"git", "make"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("releasetest: %s not found: building a release from git needs git and make", tool)
		}
	}
	root, err := RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	r, err := Lookup(root, version)
	if err != nil {
		t.Fatal(err)
	}
	git := func(args ...string) {
		t.Helper()
		cmd := exec.Command("git", append([]string{"-C", root}, args...)...)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("git %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	if err := exec.Command("git", "-C", root, "cat-file", "-e", r.Commit+"^{commit}").Run(); err != nil {
		t.Fatalf("release %s: commit %s is not in this clone (a shallow one? git fetch --unshallow)", version, r.Commit)
	}
	dir := filepath.Join(t.TempDir(), "kvipam-"+version)
	git("worktree", "add", "--detach", dir, r.Commit)
	// Cleanups run last first: the worktree is unregistered before
	// TempDir's own cleanup deletes what is left.
	t.Cleanup(func() {
		out, err := exec.Command("git", "-C", root, "worktree", "remove", "--force", dir).CombinedOutput()
		if err != nil {
			t.Logf("git worktree remove %s: %v\n%s", dir, err, out)
		}
	})
	cmd := exec.Command("make", "--no-print-directory", "build", "VERSION="+version)
	cmd.Dir = dir
	cmd.Env = CleanMakeEnv()
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("make build VERSION=%s at %s: %v\n%s", version, r.Commit, err, out)
	}
	return filepath.Join(dir, "bin")
}

// CleanMakeEnv is the environment without an enclosing make's variables
// (make test runs go test: its MAKEFLAGS would carry its command line,
// VERSION=... among them, into the make a test starts).
func CleanMakeEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		switch strings.SplitN(kv, "=", 2)[0] {
		case "MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "VERSION", "COMMIT", "LDFLAGS":
			continue
		}
		env = append(env, kv)
	}
	return env
}
