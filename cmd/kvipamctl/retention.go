package main

import (
	"context"
	"fmt"
	"time"

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
	retention, err := a.historyRetention(ctx, cli)
	if err != nil {
		return nil, err
	}
	return etcdstore.NewHistoryRecorder(cli, retention), nil
}

// withRecordingStore runs f with the store of a command whose writes end
// ownership intervals (ip migrate --cut-over): they go to IP history
// with the retention historyRecorder's would have.
func (a *app) withRecordingStore(ctx context.Context, f func(operatorStore) error) error {
	cli, err := a.client(ctx)
	if err != nil {
		return err
	}
	retention, err := a.historyRetention(ctx, cli)
	if err != nil {
		return err
	}
	if retention <= 0 {
		retention = -1 // none
	}
	return f(etcdstore.New(cli, etcdstore.Options{HistoryRetention: retention, CallTimeout: -1}))
}

// historyRetention is the retention of the history kvipamctl writes
// (historyRecorder says which).
func (a *app) historyRetention(ctx context.Context, cli *clientv3.Client) (time.Duration, error) {
	retention := a.flags.retention
	if !a.flags.retentionSet {
		h, found, err := etcdstore.New(cli, etcdstore.Options{HistoryRetention: -1, CallTimeout: -1}).HistoryRetention(ctx)
		if err != nil {
			return 0, fmt.Errorf("read the agents' IP history retention (--history-retention chooses one): %w", err)
		}
		retention = etcdstore.DefaultHistoryRetention
		if found {
			retention = h.Retention
		}
	}
	return retention, nil
}
