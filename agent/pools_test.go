package agent

import (
	"context"
	"net/http"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/cni"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// TestPoolDisableDrainDelete: an operator disables a pool in use; the
// agent follows from its watch (no restart) and hands out nothing new,
// while its pods keep and release their addresses. remove-cidr and delete
// are refused while anything remains, saying what, and pass once the
// pool is drained. Overlaps and block-size changes stay refused, naming
// both sides.
func TestPoolDisableDrainDelete(t *testing.T) {
	ctx := context.Background()
	e := etcdtest.Start(t)
	pool := allocator.Pool{Name: "drain", BlockSizeV4: 28,
		CIDRs: []netip.Prefix{netip.MustParsePrefix("10.78.0.0/24"), netip.MustParsePrefix("10.78.1.0/24")}}
	cfg := testConfig(t, e)
	cfg.Pools = []allocator.Pool{pool}
	ta := startAgent(t, cfg, Options{})
	st := etcdstore.New(etcdtest.Client(t, e), etcdstore.Options{})
	for i := range 3 {
		_, err := ta.c.Allocate(ctx, api.AllocateRequest{Owner: owner(i), Permanent: true})
		require.NoError(t, err)
	}

	_, err := st.UpdatePool(ctx, "drain", func(p *allocator.Pool) error { p.Disabled = true; return nil })
	require.NoError(t, err)
	var refused *api.Error
	require.Eventually(t, func() bool {
		_, err := ta.c.Allocate(ctx, api.AllocateRequest{Owner: owner(10), Permanent: true})
		if err == nil {
			_, _ = ta.c.Release(ctx, owner(10))
			return false
		}
		refused = apiErr(t, err)
		return true
	}, 10*time.Second, 20*time.Millisecond, "the agent follows the pool from its watch")
	require.Equal(t, http.StatusConflict, refused.Status)
	require.Equal(t, api.CodeDisabled, refused.Code)
	require.Contains(t, refused.Message, "pool drain is disabled and hands out no new addresses (kvipamctl pool enable drain)")
	require.Equal(t, cni.ErrCodePoolDisabled, cni.Code(refused), "CNI error 102")
	again, err := ta.c.Allocate(ctx, api.AllocateRequest{Owner: owner(1), Permanent: true})
	require.NoError(t, err, "a retried ADD of a pod that holds an address needs nothing new")
	require.Len(t, again.IPs, 1)
	st0 := status(t, ta)
	require.True(t, st0.Pools[0].Disabled)

	// Nothing is lost: remove-cidr and delete say what is still there.
	err = st.DeletePool(ctx, "drain")
	require.ErrorIs(t, err, etcdstore.ErrPoolInUse)
	require.ErrorContains(t, err, "3 addresses allocated, 1 blocks claimed, 1 blocks with a home, by nodes node-1")
	used := again.IPs[0].Address.Addr()
	cidrInUse := pool.CIDRs[0]
	if !cidrInUse.Contains(used) {
		cidrInUse = pool.CIDRs[1]
	}
	_, err = st.RemoveCIDR(ctx, "drain", cidrInUse, false)
	require.ErrorIs(t, err, etcdstore.ErrPoolInUse)
	require.ErrorContains(t, err, "remove cidr "+cidrInUse.String()+" from pool drain")
	for _, c := range pool.CIDRs {
		if c != cidrInUse {
			p, err := st.RemoveCIDR(ctx, "drain", c, false)
			require.NoError(t, err, "a cidr with nothing in it goes")
			require.Equal(t, []netip.Prefix{cidrInUse}, p.CIDRs)
		}
	}

	// Overlaps and block-size changes name both sides.
	half := netip.PrefixFrom(cidrInUse.Addr(), 25)
	_, err = st.EnsurePool(ctx, allocator.Pool{Name: "other", BlockSizeV4: 28, CIDRs: []netip.Prefix{half}})
	require.ErrorContains(t, err, "cidr "+half.String()+" of pool other overlaps cidr "+cidrInUse.String()+" of pool drain")
	_, err = st.UpdatePool(ctx, "drain", func(p *allocator.Pool) error { p.BlockSizeV4 = 26; return nil })
	require.ErrorContains(t, err, "ipv4 block size /28 changed to /26")

	// Drained: the pods go, the agent gives the empty block back, and
	// the pool can be deleted.
	for i := range 3 {
		_, err := ta.c.Release(ctx, owner(i))
		require.NoError(t, err)
	}
	require.Eventually(t, func() bool { return st.DeletePool(ctx, "drain") == nil }, 10*time.Second, 20*time.Millisecond,
		"a drained pool with its last block given back is deleted")
	_, err = st.GetPool(ctx, "drain")
	require.ErrorIs(t, err, records.ErrPoolNotFound)
	require.Eventually(t, func() bool {
		_, err := ta.c.Allocate(ctx, api.AllocateRequest{Owner: owner(20), Permanent: true})
		return err != nil && apiErr(t, err).Code == api.CodeDisabled
	}, 10*time.Second, 20*time.Millisecond, "a deleted pool hands out nothing")
}

// TestExhaustionErrorExplains: an ADD into a full pool is told the pool,
// family, size, allocated, reserved and borrowed counts and whether the
// shortage is temporary; STATUS says the same, and so does the CNI error.
func TestExhaustionErrorExplains(t *testing.T) {
	ctx := context.Background()
	e := etcdtest.Start(t)
	r, _ := allocator.ParseAddrRange("10.76.0.1-10.76.0.4")
	pool := allocator.Pool{Name: "tiny", BlockSizeV4: 28, CIDRs: []netip.Prefix{netip.MustParsePrefix("10.76.0.0/28")},
		Reserved: []allocator.Reservation{{Range: r, Reason: "routers"}}}
	cfg := testConfig(t, e)
	cfg.Pools = []allocator.Pool{pool}
	cfg.ReservationTTL = Duration{time.Minute}
	ta := startAgent(t, cfg, Options{})

	// 14 usable, 4 reserved: 8 permanent and 2 reservations of ADDs that
	// have not finished fill it; the shortage is temporary.
	for i := range 10 {
		_, err := ta.c.Allocate(ctx, api.AllocateRequest{Owner: owner(i), Permanent: i < 8})
		require.NoError(t, err)
	}
	_, err := ta.c.Allocate(ctx, api.AllocateRequest{Owner: owner(99), Permanent: true})
	ae := apiErr(t, err)
	require.Equal(t, http.StatusConflict, ae.Status)
	require.Equal(t, api.CodeExhausted, ae.Code)
	require.Regexp(t, `pool tiny exhausted \(ipv4\): 14 addresses, 10 allocated, 4 reserved; 1 of 1 blocks claimed\. `+
		`Temporary: 2 reservations of unfinished ADDs lapse from 20\d\d-\d\d-\d\dT`, ae.Message)
	require.Equal(t, cni.ErrCodePoolExhausted, cni.Code(ae))
	ce := cni.ToCNIError(ae)
	require.Contains(t, ce.Msg, "Temporary")
	st := status(t, ta)
	require.True(t, st.Pools[0].Exhausted)
	require.Contains(t, ae.Message, st.Pools[0].ExhaustedReason, "STATUS says the same")
	require.Equal(t, uint64(14), st.Pools[0].Size)
	require.Equal(t, uint64(4), st.Pools[0].ReservedRanges)

	// The unfinished ADDs go and two pods take their addresses for good
	// (released ones are reused once nothing else is free, cooldown or
	// not): now the shortage is permanent.
	for i := 8; i < 10; i++ {
		_, err := ta.c.Release(ctx, owner(i))
		require.NoError(t, err)
		_, err = ta.c.Allocate(ctx, api.AllocateRequest{Owner: owner(i + 10), Permanent: true})
		require.NoError(t, err)
	}
	_, err = ta.c.Allocate(ctx, api.AllocateRequest{Owner: owner(99), Permanent: true})
	ae = apiErr(t, err)
	require.Contains(t, ae.Message, "pool tiny exhausted (ipv4): 14 addresses, 10 allocated, 4 reserved; 1 of 1 blocks claimed. Permanent: every address is in use; add a cidr (kvipamctl pool add-cidr tiny) or free addresses")

	// A release clears the note.
	_, err = ta.c.Release(ctx, owner(0))
	require.NoError(t, err)
	require.False(t, status(t, ta).Pools[0].Exhausted)
}

func status(t testing.TB, ta *testAgent) api.Status {
	t.Helper()
	st, err := ta.c.Status(context.Background())
	require.NoError(t, err)
	return *st
}

// TestStickyRequestFields: a sticky request names its identity from the
// pod or its ip-claim; a bad window or a pod without a name is refused,
// naming the field; a second live pod of the identity is 409.
func TestStickyRequestFields(t *testing.T) {
	ctx := context.Background()
	e := etcdtest.Start(t)
	ta := startAgent(t, testConfig(t, e), Options{})
	_, err := ta.c.Allocate(ctx, api.AllocateRequest{Owner: owner(1), Sticky: "soon"})
	ae := apiErr(t, err)
	require.Equal(t, http.StatusBadRequest, ae.Status)
	require.Equal(t, "sticky", ae.Field)
	_, err = ta.c.Allocate(ctx, api.AllocateRequest{Owner: api.Owner{ContainerID: "c", IfName: "eth0"}, Sticky: "10m"})
	require.Equal(t, "sticky", apiErr(t, err).Field)

	one := api.Owner{ContainerID: "vm-a", IfName: "eth0", Namespace: "vms", Pod: "launcher-a"}
	two := api.Owner{ContainerID: "vm-b", IfName: "eth0", Namespace: "vms", Pod: "launcher-b"}
	r1, err := ta.c.Allocate(ctx, api.AllocateRequest{Owner: one, Sticky: "10m", IPClaim: "vm1", Permanent: true})
	require.NoError(t, err)
	for _, u := range ta.a.alloc.Usage() {
		if u.Family == allocator.IPv4 {
			require.Equal(t, 1, u.Identities, "one binding held")
			require.Equal(t, 1, u.Sticky)
		}
	}
	_, err = ta.c.Allocate(ctx, api.AllocateRequest{Owner: two, Sticky: "10m", IPClaim: "vm1", Permanent: true})
	ae = apiErr(t, err)
	require.Equal(t, http.StatusConflict, ae.Status)
	require.Contains(t, ae.Message, "vms/vm1 is held by pod vms/launcher-a")
	require.Equal(t, cni.ErrCodeAddressInUse, cni.Code(ae))
	// The first launcher goes; the next, under another name, gets its addresses.
	_, err = ta.c.Release(ctx, one)
	require.NoError(t, err)
	r2, err := ta.c.Allocate(ctx, api.AllocateRequest{Owner: two, Sticky: "10m", IPClaim: "vm1", Permanent: true})
	require.NoError(t, err)
	require.Equal(t, r1.IPs[0].Address, r2.IPs[0].Address)
}
