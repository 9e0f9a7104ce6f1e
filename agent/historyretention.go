package agent

import (
	"context"
	"time"

	"github.com/hashicorp/go-hclog"
)

// retentionPublisher stores the agents' IP-history retention in etcd
// (etcdstore.Store).
type retentionPublisher interface {
	PublishHistoryRetention(ctx context.Context, retention time.Duration, node string) (written bool, err error)
}

// publishHistoryRetention stores this agent's --history-retention in etcd
// when etcd holds another, so that kvipamctl's deletes keep their IP
// history records as long as the agents do without being told
// (docs/etcd-schema.md, "History setting"). It never stops the agent: a
// failure is logged, and kvipamctl then uses what etcd holds (or its
// default).
func publishHistoryRetention(ctx context.Context, st retentionPublisher, retention time.Duration, node string, log hclog.Logger) {
	written, err := st.PublishHistoryRetention(ctx, retention, node)
	switch {
	case err != nil:
		log.Warn("could not store the history retention in etcd; kvipamctl uses what etcd holds", "retention", retention, "error", err)
	case written:
		log.Info("stored the history retention in etcd for kvipamctl", "retention", retention)
	}
}
