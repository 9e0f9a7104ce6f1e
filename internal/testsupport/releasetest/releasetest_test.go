package releasetest

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// heavy skips a test that builds kvipam with go build: under -short, and
// under the race detector (make race), which cannot see into the builds,
// subprocesses that make test has already run without it.
func heavy(t *testing.T) {
	t.Helper()
	if testing.Short() {
		t.Skip("builds kvipam: not under -short")
	}
	if raceEnabled {
		t.Skip("builds kvipam in subprocesses the race detector does not see: make test runs this without -race")
	}
	for _, tool := range []string{"git", "make", "sha256sum"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s not found: a release build needs git, make and sha256sum", tool)
		}
	}
}

func repoRoot(t *testing.T) string {
	t.Helper()
	root, err := RepoRoot()
	require.NoError(t, err)
	return root
}

func TestValidVersion(t *testing.T) {
	for _, v := range []string{"v0.1.0", "v1.0.0", "v10.20.30", "v1.2.3-rc.0", "v1.2.3-rc.12"} {
		require.True(t, ValidVersion(v), v)
	}
	for _, v := range []string{"", "0.1.0", "v0.1", "v0.1.0.1", "v01.0.0", "v0.1.0-beta", "v0.1.0-rc.01", "v0.1.0-rc", "v0.1.0+build", "V0.1.0", "v0.1.0-dirty"} {
		require.False(t, ValidVersion(v), v)
	}
}

// TestReleasesFile: RELEASES parses, and every release has its CHANGELOG
// section (under an Unreleased one).
func TestReleasesFile(t *testing.T) {
	root := repoRoot(t)
	rs, err := Read(root)
	require.NoError(t, err)
	require.NotEmpty(t, rs)
	require.Equal(t, "v0.1.0", rs[0].Version)
	changelog, err := os.ReadFile(filepath.Join(root, "CHANGELOG.md"))
	require.NoError(t, err)
	require.Regexp(t, `(?m)^## \[Unreleased\]$`, string(changelog))
	for _, r := range rs {
		require.Regexp(t, `(?m)^## \[`+regexp.QuoteMeta(r.Version)+`\] - \d{4}-\d{2}-\d{2}$`, string(changelog), "CHANGELOG.md section of %s", r.Version)
	}
}

func TestReadRefusesMalformedLines(t *testing.T) {
	sha := strings.Repeat("ab", 20)
	for name, body := range map[string]string{
		"not semver":    "0.1.0 " + sha + "\n",
		"short commit":  "v0.1.0 8fcec4f\n",
		"no commit":     "v0.1.0\n",
		"extra field":   "v0.1.0 " + sha + " today\n",
		"listed twice":  "v0.1.0 " + sha + "\nv0.1.0 " + sha + "\n",
		"upper-case id": "v0.1.0 " + strings.ToUpper(sha) + "\n",
	} {
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			require.NoError(t, os.WriteFile(filepath.Join(dir, File), []byte("# comment\n\n"+body), 0o644))
			_, err := Read(dir)
			require.Error(t, err)
		})
	}
	dir := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(dir, File), []byte("# comment\nv0.1.0 "+sha+"\n\nv0.2.0-rc.1 "+sha+"\n"), 0o644))
	rs, err := Read(dir)
	require.NoError(t, err)
	require.Equal(t, []Release{{"v0.1.0", sha}, {"v0.2.0-rc.1", sha}}, rs)
	_, err = Lookup(dir, "v0.3.0")
	require.ErrorContains(t, err, "v0.3.0 is not in RELEASES")
}

// TestReleaseScriptRefuses: scripts/release.sh, copied into a scratch
// repository, refuses before building anything.
func TestReleaseScriptRefuses(t *testing.T) {
	if _, err := exec.LookPath("git"); err != nil {
		t.Skip("git not found: the release script needs it")
	}
	script, err := os.ReadFile(filepath.Join(repoRoot(t), "scripts", "release.sh"))
	require.NoError(t, err)
	git := func(dir string, args ...string) string {
		t.Helper()
		out, err := exec.Command("git", append([]string{"-C", dir, "-c", "user.name=t", "-c", "user.email=t@example.com", "-c", "commit.gpgsign=false"}, args...)...).CombinedOutput()
		require.NoError(t, err, "git %v: %s", args, out)
		return strings.TrimSpace(string(out))
	}
	// repo is a committed scratch repository with the script and a
	// CHANGELOG.md holding changelog.
	repo := func(changelog string) string {
		dir := t.TempDir()
		require.NoError(t, os.MkdirAll(filepath.Join(dir, "scripts"), 0o755))
		require.NoError(t, os.WriteFile(filepath.Join(dir, "scripts", "release.sh"), script, 0o755))
		require.NoError(t, os.WriteFile(filepath.Join(dir, "CHANGELOG.md"), []byte(changelog), 0o644))
		git(dir, "init", "-q")
		git(dir, "add", "-A")
		git(dir, "commit", "-q", "-m", "scratch")
		return dir
	}
	released := "# Changelog\n\n## [Unreleased]\n\n## [v0.1.0] - 2026-12-02\n"
	run := func(dir string, env ...string) string {
		t.Helper()
		cmd := exec.Command("./scripts/release.sh")
		cmd.Dir = dir
		cmd.Env = append(CleanMakeEnv(), append([]string{"LDFLAGS=-X main.x=y", "GO=false", "MAKE=false"}, env...)...)
		out, err := cmd.CombinedOutput()
		require.Error(t, err, "release.sh %v succeeded: %s", env, out)
		return string(out)
	}

	clean := repo(released)
	for _, v := range []string{"", "0.1.0", "v0.1", "v0.1.0-beta", "v0.1.0-dirty", "8fcec4f"} {
		require.Contains(t, run(clean, "VERSION="+v), "is not a release version: use make release VERSION=vMAJOR.MINOR.PATCH", v)
	}
	require.Contains(t, run(clean, "VERSION=v0.1.0", "LDFLAGS="), "run this as make release")
	require.Contains(t, run(clean, "VERSION=v0.1.0", "COMMIT="+strings.Repeat("0", 40)), "is not HEAD")
	require.Contains(t, run(clean, "VERSION=v0.2.0"), `CHANGELOG.md has no "## [v0.2.0] - YYYY-MM-DD" section`)
	// v0.1.0's dots are not wildcards.
	require.Contains(t, run(repo("## [v0x1x0] - 2026-12-02\n"), "VERSION=v0.1.0"), "CHANGELOG.md has no")
	require.Contains(t, run(clean, "VERSION=v0.1.0", "RELEASE_OUT="+t.TempDir()), "already exists: a release is never overwritten")
	// Past every check, it looks for the commands (none in this scratch
	// repository).
	require.Contains(t, run(clean, "VERSION=v0.1.0", "RELEASE_OUT="+filepath.Join(t.TempDir(), "out")), "no command cmd/kvipam-agent")

	require.NoError(t, os.WriteFile(filepath.Join(clean, "new.go"), []byte("package x\n"), 0o644))
	require.Contains(t, run(clean, "VERSION=v0.1.0"), "the tree has uncommitted changes or untracked files")
	git(clean, "add", "new.go")
	require.Contains(t, run(clean, "VERSION=v0.1.0"), "the tree has uncommitted changes or untracked files")
}

// TestReleaseBuild: make release, narrowed to this machine's architecture,
// two commands and no image, gives binaries whose --version names the
// VERSION and HEAD, and a SHA256SUMS that sha256sum -c verifies (and that
// catches a changed file).
func TestReleaseBuild(t *testing.T) {
	heavy(t)
	if runtime.GOOS != "linux" || (runtime.GOARCH != "amd64" && runtime.GOARCH != "arm64") {
		t.Skipf("releases are linux/amd64 and linux/arm64: this is %s/%s", runtime.GOOS, runtime.GOARCH)
	}
	root := repoRoot(t)
	head, err := exec.Command("git", "-C", root, "rev-parse", "HEAD").Output()
	require.NoError(t, err)
	commit := strings.TrimSpace(string(head))
	out := filepath.Join(t.TempDir(), "release")
	const version = "v0.0.1-rc.1"
	cmd := exec.Command("make", "--no-print-directory", "-C", root, "release", "VERSION="+version,
		"RELEASE_TRIAL=1", "RELEASE_ARCHS="+runtime.GOARCH, "RELEASE_CMDS=kvipam-agent kvipamctl", "RELEASE_IMAGE=0", "RELEASE_OUT="+out)
	cmd.Env = CleanMakeEnv()
	b, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", b)

	for _, c := range []string{"kvipam-agent", "kvipamctl"} {
		got, err := exec.Command(filepath.Join(out, c+"-linux-"+runtime.GOARCH), "--version").CombinedOutput()
		require.NoError(t, err, "%s", got)
		require.True(t, strings.HasPrefix(string(got), c+" "+version+" (commit "+commit+", go"), "%s --version: %s", c, got)
	}
	sums, err := os.ReadFile(filepath.Join(out, "SHA256SUMS"))
	require.NoError(t, err)
	require.Regexp(t, `^[0-9a-f]{64}  kvipam-agent-linux-`+runtime.GOARCH+`\n[0-9a-f]{64}  kvipamctl-linux-`+runtime.GOARCH+`\n$`, string(sums))
	check := exec.Command("sha256sum", "-c", "SHA256SUMS")
	check.Dir = out
	b, err = check.CombinedOutput()
	require.NoError(t, err, "%s", b)

	f, err := os.OpenFile(filepath.Join(out, "kvipamctl-linux-"+runtime.GOARCH), os.O_WRONLY|os.O_APPEND, 0)
	require.NoError(t, err)
	_, err = f.Write([]byte{0})
	require.NoError(t, err)
	require.NoError(t, f.Close())
	check = exec.Command("sha256sum", "-c", "SHA256SUMS")
	check.Dir = out
	b, err = check.CombinedOutput()
	require.Error(t, err, "sha256sum -c passed a changed file: %s", b)
	require.Contains(t, string(b), "kvipamctl-linux-"+runtime.GOARCH+": FAILED")
}

// TestBuildRecordedRelease: the first release, built from git at the
// commit RELEASES records, says so in its --version.
func TestBuildRecordedRelease(t *testing.T) {
	heavy(t)
	r, err := Lookup(repoRoot(t), "v0.1.0")
	require.NoError(t, err)
	bin := Build(t, "v0.1.0")
	got, err := exec.Command(filepath.Join(bin, "kvipam-agent"), "--version").CombinedOutput()
	require.NoError(t, err, "%s", got)
	require.True(t, strings.HasPrefix(string(got), "kvipam-agent v0.1.0 (commit "+r.Commit+", go"), "kvipam-agent --version: %s", got)
}
