package cluster

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sync"
)

// etcdPackage is the main package the members run, built from this module
// so that its etcd version is go.mod's.
const etcdPackage = "github.com/kvipam/kvipam/e2e/cluster/etcd"

// etcdutlPackage is the real etcdutl (a tool dependency in go.mod), for
// restoring snapshots as operators do.
const etcdutlPackage = "go.etcd.io/etcd/etcdutl/v3"

// The etcd binary, built once per test process by etcdBinary.
var (
	buildOnce sync.Once
	buildDir  string
	buildErr  error
)

// etcdBinary returns the path of the etcd binary, building it (and
// etcdutl, snapshot.go) on the first call, in one go build. go build runs
// in this source file's directory when it exists (not with -trimpath),
// else in the working directory, which must then be inside this module,
// as go test's is. The Go build cache makes the build cheap after the
// first one: about 2 s on 2 cores, mostly linking.
func etcdBinary() (string, error) {
	buildOnce.Do(func() {
		buildDir, buildErr = os.MkdirTemp("", "kvipam-cluster-bin-")
		if buildErr != nil {
			buildErr = fmt.Errorf("make binary dir: %w", buildErr)
			return
		}
		cmd := exec.Command("go", "build", "-o", buildDir+string(filepath.Separator), etcdPackage, etcdutlPackage)
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if _, file, _, ok := runtime.Caller(0); ok {
			if _, err := os.Stat(file); err == nil {
				cmd.Dir = filepath.Dir(file)
			}
		}
		if msg, err := cmd.CombinedOutput(); err != nil {
			buildErr = fmt.Errorf("go build %s %s: %w\n%s", etcdPackage, etcdutlPackage, err, msg)
		}
	})
	if buildErr != nil {
		return "", buildErr
	}
	return filepath.Join(buildDir, "etcd"), nil
}

// etcdutlBinary returns the path of the etcdutl binary (built with etcd).
func etcdutlBinary() (string, error) {
	if _, err := etcdBinary(); err != nil {
		return "", err
	}
	return filepath.Join(buildDir, "etcdutl"), nil
}

// RemoveBinaries deletes the etcd binary built by Start, if any. Call it
// from TestMain after m.Run; a test process that does not leaves one
// directory of about 40 MB in os.TempDir.
func RemoveBinaries() {
	if buildDir != "" {
		_ = os.RemoveAll(buildDir)
	}
}
