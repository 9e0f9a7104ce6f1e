package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvipam/kvipam/agent/api"
)

// BenchmarkIPAMAddCPU measures what one ADD of kvipam-ipam costs its
// process: the CPU (user + system, the child's rusage) of an exec that
// parses the configuration, logs at info to a file, makes its one call
// to an agent (a stand-in served here on a unix socket, answering at
// once) and prints the result. It needs root, for the pod's netns
// (a namespace of its own: skel refuses the plugin's). No netns work: what is left is the
// plugin's start-up, its client and its logger. The plugin is built from
// this tree, or is KVIPAM_IPAM_BIN when set (an older build, to
// compare):
//
//	go test -run '^$' -bench BenchmarkIPAMAddCPU -benchtime 300x ./cmd/kvipam-ipam
func BenchmarkIPAMAddCPU(b *testing.B) {
	dir := b.TempDir()
	plugin := os.Getenv("KVIPAM_IPAM_BIN")
	if plugin == "" {
		plugin = filepath.Join(dir, "kvipam-ipam")
		if out, err := exec.Command("go", "build", "-o", plugin, ".").CombinedOutput(); err != nil {
			b.Fatalf("go build: %v\n%s", err, out)
		}
	}
	sock := filepath.Join(dir, "agent.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		b.Fatal(err)
	}
	answer, _ := json.Marshal(api.AllocateResponse{Pool: "default", State: "allocated", MTU: 1500, IPs: []api.IPConfig{{
		Address: netip.MustParsePrefix("10.1.0.5/32"), Family: "ipv4",
		Gateway: netip.MustParseAddr("169.254.1.1"), Block: netip.MustParsePrefix("10.1.0.0/26"),
	}}})
	mux := http.NewServeMux()
	mux.HandleFunc("POST "+api.PathAllocate, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(answer)
	})
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	b.Cleanup(func() { _ = srv.Close() })
	conf := fmt.Appendf(nil, `{"cniVersion":"1.0.0","name":"br","type":"bridge","ipam":{"type":"kvipam-ipam","agentSocket":%q,"delQueueDir":%q,"logLevel":"info","logFile":%q}}`,
		sock, filepath.Join(dir, "queue"), filepath.Join(dir, "plugin.log"))

	netns := scratchNetns(b)

	var cpu time.Duration
	n := 0
	add := func() {
		cmd := exec.Command(plugin)
		cmd.Env = []string{"CNI_COMMAND=ADD", fmt.Sprintf("CNI_CONTAINERID=c%d", n), "CNI_IFNAME=eth0", "CNI_NETNS=" + netns, "CNI_PATH=/opt/cni/bin", "PATH=/usr/bin:/bin"}
		cmd.Stdin = bytes.NewReader(conf)
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := cmd.Run(); err != nil {
			b.Fatalf("ADD: %v\n%s", err, out.String())
		}
		if !bytes.Contains(out.Bytes(), []byte(`"10.1.0.5/26"`)) {
			b.Fatalf("ADD answered %s", out.String())
		}
		cpu += cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime()
		n++
	}
	add() // page cache and the like
	cpu, n = 0, 0
	for b.Loop() {
		add()
	}
	b.ReportMetric(float64(cpu)/float64(n)/1e6, "add-cpu-ms/exec")
}

// scratchNetns returns the path of a fresh network namespace, which a
// locked thread holds until the benchmark ends; nothing is left on the
// host. It skips b when the namespace cannot be made (not root).
func scratchNetns(b *testing.B) string {
	b.Helper()
	path, end := make(chan string), make(chan struct{})
	go func() {
		runtime.LockOSThread() // never unlocked: the thread ends with its namespace
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			close(path)
			return
		}
		path <- fmt.Sprintf("/proc/%d/task/%d/ns/net", os.Getpid(), unix.Gettid())
		<-end
	}()
	p, ok := <-path
	if !ok {
		b.Skip("cannot make a network namespace (needs root)")
	}
	b.Cleanup(func() { close(end) })
	return p
}
