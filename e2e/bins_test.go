package e2e

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/kvipam/kvipam/e2e/cluster"
)

// The binaries every test runs, built once per test binary.
var (
	binOnce sync.Once
	binDir  string
	binErr  error
)

// buildTargets are go build targets, all from this module's go.mod.
var buildTargets = []string{
	"github.com/kvipam/kvipam/cmd/kvipam",
	"github.com/kvipam/kvipam/cmd/kvipam-ipam",
	"github.com/kvipam/kvipam/cmd/kvipam-agent",
	"github.com/kvipam/kvipam/cmd/kvipamctl",
	"github.com/containernetworking/plugins/plugins/main/bridge",
	"github.com/containernetworking/plugins/plugins/main/loopback",
	"github.com/containernetworking/plugins/plugins/main/macvlan",
	"github.com/containernetworking/plugins/plugins/ipam/host-local",
	"github.com/containernetworking/plugins/plugins/meta/portmap",
	"github.com/containernetworking/plugins/plugins/meta/bandwidth",
	"github.com/containernetworking/plugins/plugins/meta/tuning",
	"github.com/containernetworking/cni/cnitool",
}

func TestMain(m *testing.M) {
	code := m.Run()
	cluster.RemoveBinaries()
	if binDir != "" {
		_ = os.RemoveAll(binDir)
	}
	os.Exit(code)
}

// requireRoot skips a test that cannot create network namespaces.
func requireRoot(tb testing.TB) {
	tb.Helper()
	if os.Geteuid() != 0 {
		tb.Skip("needs root: the e2e tests create network namespaces and run CNI plugins (CI runs as root)")
	}
}

// bins returns the directory holding every binary, building them on the
// first call.
func bins(tb testing.TB) string {
	tb.Helper()
	requireRoot(tb)
	binOnce.Do(func() {
		binDir, binErr = os.MkdirTemp("", "kvipam-e2e-bin-")
		if binErr != nil {
			return
		}
		args := append([]string{"build", "-o", binDir + string(filepath.Separator)}, buildTargets...)
		cmd := exec.Command("go", args...)
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			binErr = fmt.Errorf("go %s: %w\n%s", strings.Join(args, " "), err, out)
		}
	})
	if binErr != nil {
		tb.Fatalf("build binaries: %v", binErr)
	}
	return binDir
}
