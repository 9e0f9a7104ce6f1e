package main

import (
	"context"
	"fmt"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator/etcdstore"
)

// historyRecorder returns the recorder of the IP history that kvipamctl's
// deletes (release, node remove) write, nil for none. Its retention is
// --history-retention when given; else the one the agents stored in etcd
// (etcdstore.HistorySetting), so the operator's records last as long as
// the agents' without being told on every call; else, when no agent has
// stored one (agents older than the setting), DefaultHistoryRetention, the
// agents' default.
func (a *app) historyRecorder(ctx context.Context, cli *clientv3.Client) (*etcdstore.HistoryRecorder, error) {
	retention := a.flags.retention
	if !a.flags.retentionSet {
		h, found, err := etcdstore.New(cli, etcdstore.Options{HistoryRetention: -1, CallTimeout: -1}).HistoryRetention(ctx)
		if err != nil {
			return nil, fmt.Errorf("read the agents' IP history retention (--history-retention chooses one): %w", err)
		}
		retention = etcdstore.DefaultHistoryRetention
		if found {
			retention = h.Retention
		}
	}
	return etcdstore.NewHistoryRecorder(cli, retention), nil
}
