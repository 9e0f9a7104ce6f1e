package main

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestKvipamctlUnknownSubcommand: a mistyped subcommand is an error (exit
// 2, "unknown command", a suggestion), not help and exit 0; --version
// works, and the binaries `make build` makes report the build's version
// (git describe) and commit.
func TestKvipamctlUnknownSubcommand(t *testing.T) {
	run := func(args ...string) (int, string, string) {
		var out, errb bytes.Buffer
		code := Run(context.Background(), args, &out, &errb, func(string) string { return "" })
		return code, out.String(), errb.String()
	}
	t.Run("mistyped subcommand", func(t *testing.T) {
		for _, tc := range []struct {
			args []string
			want string
		}{
			{[]string{"pool", "delte", "blue"}, `unknown command "delte" for "kvipamctl pool": did you mean "delete"?`},
			{[]string{"pool", "lst"}, `unknown command "lst" for "kvipamctl pool": did you mean "list"?`},
			{[]string{"node", "frobnicate"}, `unknown command "frobnicate" for "kvipamctl node"`},
			{[]string{"pools", "list"}, `unknown command "pools" for "kvipamctl"`},
		} {
			code, out, errs := run(tc.args...)
			require.Equal(t, exitError, code, "kvipamctl %v: stdout %q, stderr %q", tc.args, out, errs)
			require.Contains(t, errs, tc.want)
			require.Empty(t, out, "no help on stdout")
		}
		code, out, _ := run("pool")
		require.Equal(t, exitOK, code, "a command group alone prints its help")
		require.Contains(t, out, "Available Commands")
	})
	t.Run("--version", func(t *testing.T) {
		code, out, errs := run("--version")
		require.Equal(t, exitOK, code, errs)
		require.True(t, strings.HasPrefix(out, "kvipamctl "), out)
	})
	t.Run("built by make", func(t *testing.T) {
		if testing.Short() {
			t.Skip("builds every command")
		}
		for _, tool := range []string{"make", "git", "go"} {
			if _, err := exec.LookPath(tool); err != nil {
				t.Skipf("no %s: %v", tool, err)
			}
		}
		root, err := filepath.Abs("../..")
		require.NoError(t, err)
		git := func(args ...string) string {
			out, err := exec.Command("git", append([]string{"-C", root}, args...)...).Output()
			require.NoError(t, err)
			return strings.TrimSpace(string(out))
		}
		if err := exec.Command("git", "-C", root, "rev-parse", "HEAD").Run(); err != nil {
			t.Skipf("not a git checkout: %v", err)
		}
		bin := t.TempDir()
		out, err := exec.Command("make", "-C", root, "--no-print-directory", "build", "BIN="+bin).CombinedOutput()
		require.NoError(t, err, string(out))
		version, commit := git("describe", "--always", "--dirty"), git("rev-parse", "HEAD")
		for _, tc := range []struct {
			bin  string
			args []string
			env  []string
		}{
			{"kvipamctl", []string{"--version"}, nil},
			{"kvipamctl", []string{"version"}, nil},
			{"kvipam-agent", []string{"--version"}, nil},
			{"kvipam-agent", []string{"version"}, nil},
			{"kvipam", nil, []string{"CNI_COMMAND="}}, // skel prints its about text
			{"kvipam-ipam", nil, []string{"CNI_COMMAND="}},
		} {
			cmd := exec.Command(filepath.Join(bin, tc.bin), tc.args...)
			cmd.Env = append(os.Environ(), tc.env...)
			out, err := cmd.CombinedOutput()
			require.NoError(t, err, "%s %v: %s", tc.bin, tc.args, out)
			require.Contains(t, string(out), version, "%s %v", tc.bin, tc.args)
			require.Contains(t, string(out), commit, "%s %v", tc.bin, tc.args)
		}
	})
}
