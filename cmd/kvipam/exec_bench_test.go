package main

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
)

// minimalMain is the baseline: a Go program that does no more than print
// a CNI VERSION answer.
const minimalMain = `package main

import "os"

func main() {
	os.Stdout.WriteString("{\"cniVersion\":\"1.1.0\",\"supportedVersions\":[\"1.0.0\",\"1.1.0\"]}\n")
}
`

// BenchmarkPluginExecCPU measures what starting the plugin costs: the CPU
// (user + system, from the child's rusage) of one exec of the plugin with
// CNI_COMMAND=VERSION, against the same for a minimal Go binary built
// here, in the same run and interleaved. It reports both in ms an exec
// and their ratio. The plugin is built from this tree, or is
// KVIPAM_PLUGIN_BIN when set (an older build, to compare):
//
//	go test -run '^$' -bench BenchmarkPluginExecCPU -benchtime 300x ./cmd/kvipam
func BenchmarkPluginExecCPU(b *testing.B) {
	dir := b.TempDir()
	plugin := os.Getenv("KVIPAM_PLUGIN_BIN")
	if plugin == "" {
		plugin = filepath.Join(dir, "kvipam")
		goBuild(b, "", plugin, ".")
	}
	src := filepath.Join(dir, "minimal", "main.go")
	if err := os.MkdirAll(filepath.Dir(src), 0o755); err != nil {
		b.Fatal(err)
	}
	if err := os.WriteFile(src, []byte(minimalMain), 0o644); err != nil {
		b.Fatal(err)
	}
	minimal := filepath.Join(dir, "minimal-go")
	goBuild(b, filepath.Dir(src), minimal, "main.go")
	execCPU(b, plugin) // page cache and the like, for both
	execCPU(b, minimal)

	var pluginCPU, minimalCPU time.Duration
	n := 0
	for b.Loop() {
		pluginCPU += execCPU(b, plugin)
		minimalCPU += execCPU(b, minimal)
		n++
	}
	perExec := func(d time.Duration) float64 { return float64(d) / float64(n) / 1e6 }
	b.ReportMetric(perExec(pluginCPU), "plugin-cpu-ms/exec")
	b.ReportMetric(perExec(minimalCPU), "minimal-go-cpu-ms/exec")
	b.ReportMetric(float64(pluginCPU)/float64(minimalCPU), "plugin/minimal")
}

// goBuild builds pkg (a package path or a file, from dir; "" is this
// package's) into out.
func goBuild(b *testing.B, dir, out, pkg string) {
	b.Helper()
	cmd := exec.Command("go", "build", "-o", out, pkg)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "GOFLAGS=", "GO111MODULE=auto")
	if o, err := cmd.CombinedOutput(); err != nil {
		b.Fatalf("go build %s: %v\n%s", pkg, err, o)
	}
}

// execCPU runs bin with CNI_COMMAND=VERSION and returns its CPU time.
func execCPU(b *testing.B, bin string) time.Duration {
	b.Helper()
	cmd := exec.Command(bin)
	cmd.Env = []string{"CNI_COMMAND=VERSION", "PATH=/usr/bin:/bin"}
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		b.Fatalf("%s: %v\n%s", bin, err, out.String())
	}
	if !bytes.Contains(out.Bytes(), []byte(`"supportedVersions"`)) {
		b.Fatalf("%s answered VERSION with %q", bin, out.String())
	}
	return cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime()
}
