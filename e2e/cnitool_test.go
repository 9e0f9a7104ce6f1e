package e2e

import (
	"os"
	"os/exec"
	"testing"
)

// TestCnitoolScript runs testdata/cnitool.sh: the same flow as
// TestKvipamTwoPods, with cnitool and ip as a person would run them.
func TestCnitoolScript(t *testing.T) {
	bin := bins(t)
	for _, tool := range []string{"bash", "ip", "unshare", "ping", "mount"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("the cnitool script needs %s (.ci/run installs iproute2 and iputils-ping)", tool)
		}
	}
	cmd := exec.Command("bash", "testdata/cnitool.sh")
	cmd.Env = append(os.Environ(), "BIN="+bin, "WORK="+t.TempDir())
	out, err := cmd.CombinedOutput()
	t.Logf("cnitool.sh:\n%s", out)
	if err != nil {
		t.Fatalf("cnitool.sh: %v", err)
	}
}
