package k8s

import (
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestProcWatchSeesCNIExecs: a process run with a CNI environment is
// seen with its executable, command and container ID, and its fork,
// exec and exit in order on the wall clock; one without is not kept.
func TestProcWatchSeesCNIExecs(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: the proc connector")
	}
	w, err := startProcWatch()
	require.NoError(t, err)
	t.Cleanup(w.close)
	before := time.Now()
	cmd := exec.Command("sleep", "0.05")
	cmd.Env = append(os.Environ(), "CNI_COMMAND=ADD", "CNI_CONTAINERID=c0ffee")
	require.NoError(t, cmd.Run())
	require.NoError(t, exec.Command("true").Run())
	after := time.Now()
	var got map[string][]cniExec
	require.Eventually(t, func() bool {
		got = w.execsOf("ADD", map[string]bool{"c0ffee": true})
		return len(got["c0ffee"]) == 1
	}, time.Minute, 10*time.Millisecond)
	e := got["c0ffee"][0]
	require.Equal(t, "sleep", e.plugin)
	require.False(t, e.fork.IsZero(), "the fork was seen")
	require.True(t, !e.fork.After(e.exec) && e.exec.Before(e.exit), "fork %s, exec %s, exit %s", e.fork, e.exec, e.exit)
	require.True(t, e.fork.After(before.Add(-50*time.Millisecond)) && e.exit.Before(after.Add(50*time.Millisecond)), "on the wall clock: %s..%s within %s..%s", e.fork, e.exit, before, after)
	require.GreaterOrEqual(t, e.took(), 50*time.Millisecond)
	t.Logf("sleep 0.05: fork to exit %s, exec to exit %s", e.took(), e.exit.Sub(e.exec))
}
