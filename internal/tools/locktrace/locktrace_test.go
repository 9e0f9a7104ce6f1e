package locktrace_test

import (
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"

	"github.com/kvipam/kvipam/internal/testsupport/nstest"
	"github.com/kvipam/kvipam/internal/tools/locktrace"
)

// A trace as the kernel writes it: a spin turning into a sleep on rtnl
// (two begins, one end), a wait on the RCU funnel under rtnl, and a wait
// whose end the trace missed.
const sample = `# tracer: nop
#
          kvipam-101     [000] ...1.   10.000100: contention_begin: 00000000aaaa (flags=SPIN|MUTEX)
          kvipam-101     [000] ...1.   10.000110: <stack trace>
 => trace_event_raw_event_contention_begin
 => __mutex_lock.constprop.0
 => rtnetlink_rcv_msg
 => netlink_rcv_skb
          kvipam-101     [000] d..2.   10.000200: contention_begin: 00000000aaaa (flags=MUTEX)
          kvipam-101     [000] d..2.   10.000210: <stack trace>
 => trace_event_raw_event_contention_begin
 => __mutex_lock.constprop.0
 => rtnetlink_rcv_msg
      bridge-202     [001] ...1.   10.000300: contention_begin: 00000000bbbb (flags=SPIN|MUTEX)
      bridge-202     [001] ...1.   10.000310: <stack trace>
 => trace_event_raw_event_contention_begin
 => __mutex_lock.constprop.0
 => exp_funnel_lock
 => synchronize_rcu_expedited
 => rtnl_newlink
          kvipam-101     [000] ...1.   10.004100: contention_end: 00000000aaaa (ret=0)
      bridge-202     [001] ...1.   10.006300: contention_end: 00000000bbbb (ret=0)
   kworker/u8:5-44     [001] ...1.   10.006500: contention_begin: 00000000aaaa (flags=MUTEX)
   kworker/u8:5-44     [001] ...1.   10.006510: <stack trace>
 => trace_event_raw_event_contention_begin
 => __mutex_lock.constprop.0
 => linkwatch_event
   kworker/u8:5-44     [001] ...1.   10.006600: contention_end: 00000000aaaa (ret=0)
      host-local-303 [001] ...1.   10.007000: contention_begin: 00000000aaaa (flags=MUTEX)
      host-local-303 [001] ...1.   10.007010: <stack trace>
 => trace_event_raw_event_contention_begin
 => __mutex_lock.constprop.0
 => rtnl_newlink
`

func TestParse(t *testing.T) {
	r := locktrace.Parse(sample)
	require.Len(t, r.Waits, 3)
	require.Equal(t, 1, r.Unended)
	require.Equal(t, "linkwatch_event", r.Waits[2].Site)
	require.True(t, r.Waits[2].RTNL, "rtnl's lock, taken by an inlined rtnl_lock")

	w := r.Waits[0]
	require.Equal(t, "kvipam", w.Comm)
	require.Equal(t, 101, w.PID)
	require.Equal(t, "rtnetlink_rcv_msg", w.Site)
	require.True(t, w.RTNL)
	require.Equal(t, 4*time.Millisecond, w.Duration().Round(time.Microsecond), "from the first begin to the end")

	w = r.Waits[1]
	require.Equal(t, "bridge", w.Comm)
	require.Equal(t, "exp_funnel_lock", w.Site)
	require.False(t, w.RTNL, "the RCU funnel, taken under rtnl")

	n, d := r.Total(locktrace.All)
	require.Equal(t, 3, n)
	require.Equal(t, 10100*time.Microsecond, d.Round(time.Microsecond))
	// 10.0001-10.0041 and 10.0003-10.0063 overlap, 10.0065-10.0066
	// does not: a queue for 6.2 + 0.1 ms.
	require.Equal(t, 6300*time.Microsecond, r.Busy(locktrace.All).Round(time.Microsecond))
	by := r.By(locktrace.All, func(w locktrace.Wait) string { return w.Comm })
	require.Equal(t, []string{"bridge", "kvipam", "kworker/u8:5"}, []string{by[0].Key, by[1].Key, by[2].Key})
	require.Contains(t, r.Summary(), "rtnl: 2 waits")
}

// TestTraceSeesRTNLWaits creates veth pairs from several threads at once
// in a scratch netns: they queue on rtnl, and the trace must say so.
func TestTraceSeesRTNLWaits(t *testing.T) {
	nstest.RequireRoot(t)
	tr, err := locktrace.Start("kvipam-test")
	if errors.Is(err, locktrace.ErrUnsupported) {
		t.Skipf("skipped: %v", err)
	}
	require.NoError(t, err)
	scratch := nstest.NewNS(t)
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for g := range 4 {
		h := nstest.Handle(t, scratch) // a handle serializes its requests
		wg.Go(func() {
			for i := range 25 {
				v := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: fmt.Sprintf("lt%d-%d", g, i)}, PeerName: fmt.Sprintf("lp%d-%d", g, i)}
				if err := h.LinkAdd(v); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	r, err := tr.Stop()
	require.NoError(t, err)
	for err := range errs {
		require.NoError(t, err)
	}
	t.Log(r.Summary())
	n, d := r.Total(locktrace.IsRTNL)
	require.Positive(t, n, "4 threads making 100 veth pairs never waited for rtnl")
	require.Positive(t, d)
}
