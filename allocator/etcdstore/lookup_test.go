package etcdstore_test

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/kvstore"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

func TestHolder(t *testing.T) {
	ctx := context.Background()
	cli := etcdtest.Client(t, etcdtest.Start(t))
	st := etcdstore.New(cli, etcdstore.Options{})
	p := allocator.Pool{Name: "p", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/24"), netip.MustParsePrefix("fd00::/64")}, BlockSizeV4: 28, BlockSizeV6: 120}
	_, err := st.EnsurePool(ctx, p)
	require.NoError(t, err)
	held := netip.MustParseAddr("10.0.0.20")
	rec := records.Record{Owner: records.Owner{ContainerID: "c1", IfName: "eth0"}, Node: "n2", State: records.StateAllocated, Since: time.Now().UTC()}
	val, err := kvstore.EncodeJSON(rec)
	require.NoError(t, err)
	_, err = cli.Put(ctx, etcdstore.IPKey("p", netip.MustParsePrefix("10.0.0.16/28"), held), val)
	require.NoError(t, err)

	al, err := st.Holder(ctx, p, held)
	require.NoError(t, err)
	require.NotNil(t, al)
	require.Equal(t, "c1/eth0", al.Owner.Key())
	require.Equal(t, "n2", al.Node)

	al, err = st.Holder(ctx, p, netip.MustParseAddr("fd00::5"))
	require.NoError(t, err)
	require.Nil(t, al, "a free address has no holder")

	_, err = st.Holder(ctx, p, netip.MustParseAddr("192.0.2.1"))
	require.ErrorIs(t, err, records.ErrBadRequest)

	require.Equal(t, "c1/eth0 on n2", etcdstore.LostIP{HeldBy: "c1/eth0", HeldByNode: "n2"}.Holder())
	require.Equal(t, "nobody", etcdstore.LostIP{}.Holder())
	require.Equal(t, "unknown", etcdstore.LostIP{Unknown: true}.Holder())
}
