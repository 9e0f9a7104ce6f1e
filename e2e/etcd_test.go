package e2e

import (
	"context"
	"net"
	"strings"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
)

// ipKeys returns the allocation keys in the agent's etcd whose value names
// containerID ("" for every allocation), as key -> value.
func (n *node) ipKeys(containerID string) map[string]string {
	n.t.Helper()
	// etcd listens on the node namespace's loopback: dial from there.
	dial := func(ctx context.Context, addr string) (net.Conn, error) {
		var c net.Conn
		err := n.host.Do(func(ns.NetNS) (err error) {
			var d net.Dialer
			c, err = d.DialContext(ctx, "tcp", addr)
			return err
		})
		return c, err
	}
	cli, err := clientv3.New(clientv3.Config{
		Endpoints: []string{n.etcdEndpoint()}, DialTimeout: 10 * time.Second,
		DialOptions: []grpc.DialOption{grpc.WithContextDialer(dial)},
	})
	require.NoError(n.t, err)
	defer cli.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := cli.Get(ctx, etcdstore.AllIPsPrefix(), clientv3.WithPrefix())
	require.NoError(n.t, err)
	out := map[string]string{}
	for _, kv := range resp.Kvs {
		if containerID == "" || strings.Contains(string(kv.Value), `"containerID":"`+containerID+`"`) {
			out[string(kv.Key)] = string(kv.Value)
		}
	}
	return out
}
