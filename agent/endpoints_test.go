package agent

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/testsupport/nstest"
)

// confirmSpy runs during the allocator's confirm: inside, before the
// confirm itself, and may replace its outcome.
type confirmSpy struct {
	endpointAllocator
	inside func() error
}

func (s confirmSpy) Confirm(ctx context.Context, o records.Owner) ([]records.Allocation, error) {
	if err := s.inside(); err != nil {
		return nil, err
	}
	return s.endpointAllocator.Confirm(ctx, o)
}

// TestCreateOverlapsConfirmWithDatapath: an endpoint create programs the
// datapath and saves the record while its confirm is in etcd (the confirm
// waits to see them), and a confirm that fails (the reservation is gone)
// leaves no record and no program on the interface behind.
func TestCreateOverlapsConfirmWithDatapath(t *testing.T) {
	for _, dp := range []string{DatapathRoutes, "tc"} {
		for _, fail := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/confirm-fails=%v", dp, fail), func(t *testing.T) { testCreateOverlaps(t, dp, fail) })
		}
	}
}

func testCreateOverlaps(t *testing.T, dp string, fail bool) {
	cfg, h := hostNSConfig(t)
	if dp != DatapathRoutes {
		cfg.Datapath, cfg.BPFPinDir, cfg.BPFAttach = DatapathBPF, bpfPinDir(t), dp
	}
	ta := startAgent(t, cfg, Options{})
	ctx := context.Background()
	l := nstest.AddLink(t, h, "kvcon0")
	o := owner(1)
	_, err := ta.c.Allocate(ctx, api.AllocateRequest{Owner: o})
	require.NoError(t, err)
	m := ta.a.endpoints
	programmed := func() bool {
		if _, ok := m.records.get(o); !ok {
			return false
		}
		if dp == DatapathRoutes {
			return true
		}
		filters, err := h.FilterList(l, netlink.HANDLE_MIN_INGRESS)
		return err == nil && len(filters) > 0
	}
	var sawProgrammed atomic.Bool // set in the agent's handler
	m.mu.Lock()
	m.alloc = confirmSpy{endpointAllocator: m.alloc, inside: func() error {
		deadline := time.Now().Add(5 * time.Second)
		for !sawProgrammed.Load() && time.Now().Before(deadline) {
			sawProgrammed.Store(programmed())
			time.Sleep(time.Millisecond) // polling the kernel's and the records' state: no event to await
		}
		if fail {
			return fmt.Errorf("spy: %w", records.ErrReservationGone)
		}
		return nil
	}}
	m.mu.Unlock()

	_, err = ta.c.CreateEndpoint(ctx, api.EndpointRequest{Owner: o, HostIfName: "kvcon0"})
	require.True(t, sawProgrammed.Load(), "the datapath and record were not done while the confirm was under way")
	eps, lerr := ta.c.Endpoints(ctx)
	require.NoError(t, lerr)
	if !fail {
		require.NoError(t, err)
		require.Len(t, eps, 1)
		require.True(t, programmed())
		return
	}
	require.Error(t, err)
	require.Empty(t, eps, "the record of an endpoint whose confirm failed was kept")
	if dp != DatapathRoutes {
		filters, err := h.FilterList(l, netlink.HANDLE_MIN_INGRESS)
		require.NoError(t, err)
		require.Empty(t, filters, "the program of an endpoint whose confirm failed was left attached")
	}
}
