package agent

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/agent/client"
	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/internal/testsupport/nstest"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// BenchmarkAgentRestart: how long an agent takes from its start to ready
// (allocating again) on a node with 10,000 allocations and 200 endpoints,
// against the same agent on an empty node (the baseline), in the same run,
// alternating. Endpoints have real host veths in a scratch namespace.
// Then, once, untimed, it runs each node's agent as a kvipam-agent process
// and reports the process's resident set (VmRSS) once ready, idle (the
// empty node) and with the 10,000 allocations.
func BenchmarkAgentRestart(b *testing.B) {
	nstest.RequireRoot(b)
	const allocations, endpoints = 10_000, 200
	big := allocator.Pool{Name: "default", BlockSizeV4: 26, CIDRs: []netip.Prefix{netip.MustParsePrefix("10.78.0.0/16")}}
	setup := func(fill bool) (Config, *testAgent) {
		e := etcdtest.Start(b)
		host := nstest.NewNS(b)
		cfg := testConfig(b, e)
		cfg.Pools, cfg.NetNS = []allocator.Pool{big}, host.Path()
		ta := startAgent(b, cfg, Options{})
		if !fill {
			return cfg, ta
		}
		h := nstest.Handle(b, host)
		ctx := context.Background()
		var wg sync.WaitGroup
		errs := make(chan error, 16)
		for w := range 16 {
			wg.Go(func() {
				for i := w; i < allocations; i += 16 {
					if _, err := ta.c.Allocate(ctx, api.AllocateRequest{Owner: owner(i), Permanent: i >= endpoints}); err != nil {
						errs <- err
						return
					}
				}
			})
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			b.Fatal(err)
		}
		for i := range endpoints {
			name := fmt.Sprintf("kvr%d", i)
			nstest.AddLink(b, h, name)
			if _, err := ta.c.CreateEndpoint(ctx, api.EndpointRequest{Owner: owner(i), HostIfName: name}); err != nil {
				b.Fatal(err)
			}
		}
		return cfg, ta
	}
	emptyCfg, empty := setup(false)
	fullCfg, full := setup(true)
	restart := func(cfg Config, ta *testAgent) (*testAgent, time.Duration) {
		ta.shutdown()
		start := time.Now()
		next := startAgent(b, cfg, Options{})
		for {
			st, err := next.c.Status(context.Background())
			if err == nil && st.Ready {
				return next, time.Since(start)
			}
			if time.Since(start) > time.Minute {
				b.Fatal("agent not ready in a minute")
			}
			time.Sleep(2 * time.Millisecond)
		}
	}
	b.ResetTimer()
	var base, op time.Duration
	for range b.N {
		var d time.Duration
		empty, d = restart(emptyCfg, empty)
		base += d
		full, d = restart(fullCfg, full)
		op += d
	}
	b.StopTimer()
	b.ReportMetric(op.Seconds()/float64(b.N), "s/restart-10k")
	b.ReportMetric(base.Seconds()/float64(b.N), "s/restart-empty")
	b.ReportMetric(float64(op)/float64(base), "x-empty")

	bin := filepath.Join(b.TempDir(), "kvipam-agent")
	if out, err := exec.Command("go", "build", "-o", bin, "github.com/kvipam/kvipam/cmd/kvipam-agent").CombinedOutput(); err != nil {
		b.Fatalf("build kvipam-agent: %v\n%s", err, out)
	}
	empty.shutdown()
	b.ReportMetric(processRSS(b, bin, emptyCfg), "MB/rss-idle")
	full.shutdown()
	b.ReportMetric(processRSS(b, bin, fullCfg), "MB/rss-10k")
}

// processRSS runs the agent of cfg as a kvipam-agent process (bin) until
// it is ready and a second more, and returns its resident set in MB.
func processRSS(b *testing.B, bin string, cfg Config) float64 {
	b.Helper()
	conf, err := json.Marshal(cfg)
	require.NoError(b, err)
	file := filepath.Join(b.TempDir(), "agent.json") // YAML is a superset of JSON
	require.NoError(b, os.WriteFile(file, conf, 0o600))
	var log bytes.Buffer
	cmd := exec.Command(bin, "--config", file, "--log-level", "warn")
	cmd.Stdout, cmd.Stderr = &log, &log
	require.NoError(b, cmd.Start())
	stop := func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		_ = cmd.Wait()
	}
	defer stop()
	c := client.New(cfg.Socket, 5*time.Second)
	for start := time.Now(); ; time.Sleep(20 * time.Millisecond) {
		if st, err := c.Status(context.Background()); err == nil && st.Ready {
			break
		}
		if time.Since(start) > time.Minute {
			stop()
			b.Fatalf("kvipam-agent not ready in a minute:\n%s", log.String())
		}
	}
	time.Sleep(time.Second)
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", cmd.Process.Pid))
	require.NoError(b, err)
	for _, line := range strings.Split(string(status), "\n") {
		if kb, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			n, err := strconv.Atoi(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(kb), "kB")))
			require.NoError(b, err)
			return float64(n) / 1024
		}
	}
	b.Fatalf("no VmRSS in /proc/%d/status", cmd.Process.Pid)
	return 0
}
