package nodealloc_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"runtime/metrics"
	"runtime/pprof"
	"syscall"
	"time"

	"github.com/kvipam/kvipam/e2e/cluster"
)

// cpuSample is where the CPU went up to one moment: this process's (the
// simulated nodes' allocators, their clients and, embedded, etcd) and the
// etcd member processes' (zero when etcd is embedded). Which functions
// took it, the GC's share among them, is the profiles' to say
// (profileEnv): the runtime's GC counters move only when a cycle ends.
// allocated is the bytes this process has allocated on its heap, and
// gcs its completed GC cycles: the GC's work grows with the first.
type cpuSample struct {
	wall, process, etcd time.Duration
	allocated, gcs      uint64
}

// sampleCPU reads the counters; etcdCPU is nil when etcd runs in this
// process. A counter that cannot be read fails the benchmark.
func (f *fleet) sampleCPU() cpuSample {
	s := cpuSample{wall: time.Duration(time.Now().UnixNano())}
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		f.b.Fatalf("getrusage: %v", err)
	}
	s.process = time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	ms := []metrics.Sample{{Name: "/gc/heap/allocs:bytes"}, {Name: "/gc/cycles/total:gc-cycles"}}
	metrics.Read(ms)
	s.allocated, s.gcs = ms[0].Value.Uint64(), ms[1].Value.Uint64()
	if f.etcdCPU != nil {
		d, err := f.etcdCPU()
		if err != nil {
			f.b.Fatalf("etcd members' CPU: %v", err)
		}
		s.etcd = d
	}
	return s
}

// sub is the CPU used between earlier and s.
func (s cpuSample) sub(earlier cpuSample) cpuSample {
	return cpuSample{wall: s.wall - earlier.wall, process: s.process - earlier.process, etcd: s.etcd - earlier.etcd,
		allocated: s.allocated - earlier.allocated, gcs: s.gcs - earlier.gcs}
}

func (s cpuSample) String() string {
	sec := func(d time.Duration) string { return fmt.Sprintf("%.2fs", d.Seconds()) }
	return fmt.Sprintf("%s, CPU process %s etcd %s", sec(s.wall), sec(s.process), sec(s.etcd))
}

// profileEnv names a directory: the fill then writes a CPU profile of
// the leading etcd member during its first and its last group there
// (etcd-first-group.pprof, etcd-last-group.pprof), and this process's
// (fleet-first-group.pprof, fleet-last-group.pprof), to read with go
// tool pprof. Only on the member processes (etcd=cluster3 and
// etcd=cluster3-ownhttp).
const profileEnv = "KVIPAM_FILL_PROFILE"

// groupProfile is the profiles of one fill group.
type groupProfile struct {
	etcd chan []byte
	proc bytes.Buffer
}

// startProfiles starts the profiles of a group that lasts about d, if
// profileEnv asks for them; stop them with stopProfiles.
func (f *fleet) startProfiles(ctx context.Context, d time.Duration) *groupProfile {
	if os.Getenv(profileEnv) == "" || f.leaderProfile == nil {
		return nil
	}
	p := &groupProfile{etcd: make(chan []byte, 1)}
	go func() {
		b, err := f.leaderProfile(ctx, d)
		if err != nil {
			f.b.Logf("etcd profile: %v", err)
		}
		p.etcd <- b
	}()
	if err := pprof.StartCPUProfile(&p.proc); err != nil {
		f.b.Logf("process profile: %v", err)
	}
	return p
}

// stopProfiles stops p's profiles and writes them as <name>.pprof.
func (f *fleet) stopProfiles(p *groupProfile, name string) {
	if p == nil {
		return
	}
	pprof.StopCPUProfile()
	dir := os.Getenv(profileEnv)
	for file, b := range map[string][]byte{"etcd-" + name: <-p.etcd, "fleet-" + name: p.proc.Bytes()} {
		if len(b) == 0 {
			continue
		}
		if err := os.WriteFile(filepath.Join(dir, file+".pprof"), b, 0o644); err != nil {
			f.b.Logf("write profile: %v", err)
		}
	}
}

// leaderProfile fetches a CPU profile of c's leader over d from its
// pprof endpoint (--enable-pprof), with a client certificate.
func leaderProfile(ctx context.Context, c *cluster.Cluster, d time.Duration) ([]byte, error) {
	l, err := c.Leader(ctx)
	if err != nil {
		return nil, err
	}
	tc, err := c.TLSConfig("kvipam")
	if err != nil {
		return nil, err
	}
	hc := &http.Client{Transport: &http.Transport{TLSClientConfig: tc}, Timeout: d + 30*time.Second}
	u := fmt.Sprintf("%s/debug/pprof/profile?seconds=%d", c.HTTPEndpoints()[l], int(d.Seconds()))
	resp, err := hc.Get(u)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s: %s", u, resp.Status)
	}
	return io.ReadAll(resp.Body)
}
