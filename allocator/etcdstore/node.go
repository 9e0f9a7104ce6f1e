package etcdstore

import (
	"context"
	"fmt"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/kvstore"
)

// NodeRecord is the value of NodeKey: who a node is while it is alive. It
// is written on the node's lease, so it disappears when the agent has been
// gone for longer than the TTL. Its absence is not proof that the node is
// gone (a node cut off from etcd loses it too), which is why kvipamctl node
// remove also wants the operator's statement.
type NodeRecord struct {
	Name      string    `json:"name"`
	BootID    string    `json:"bootID,omitempty"`
	Version   string    `json:"version,omitempty"`
	Addresses []string  `json:"addresses,omitempty"`
	StartedAt time.Time `json:"startedAt"`
	Lease     int64     `json:"lease"`
}

// NodesPrefix lists every live node.
func NodesPrefix() string { return Prefix + "nodes/" }

// PutNode writes the node record on lease.
func (s *Store) PutNode(ctx context.Context, r NodeRecord, lease int64) error {
	val, err := kvstore.EncodeJSON(r)
	if err != nil {
		return err
	}
	if _, err := s.cli.Put(ctx, NodeKey(r.Name), val, clientv3.WithLease(clientv3.LeaseID(lease))); err != nil {
		return fmt.Errorf("write node record %s: %w", r.Name, err)
	}
	return nil
}
