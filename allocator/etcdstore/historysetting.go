package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/kvipam/kvipam/internal/foundation/jsonkeep"
	"github.com/kvipam/kvipam/internal/foundation/retry"
	"github.com/kvipam/kvipam/kvstore"
)

// HistorySetting is the IP-history retention the agents run with (their
// --history-retention), stored once in etcd so that kvipamctl's deletes
// (release, node remove) keep their records as long as the agents keep
// theirs without being told on every call. Each agent writes it at start
// when it differs from its own: in a fleet with one setting it is that
// setting, and after a change it follows the agents as they restart.
type HistorySetting struct {
	// Retention: how long a record of an ended ownership interval is
	// kept; 0: history is off.
	Retention time.Duration
	// Node is the agent that wrote it, and At when.
	Node string
	At   time.Time
}

// historySettingJSON is HistorySetting as stored: the retention as the
// flags take it ("168h0m0s", "0s").
type historySettingJSON struct {
	Retention string    `json:"retention"`
	Node      string    `json:"node,omitempty"`
	At        time.Time `json:"at"`
	// Unknown: members this version does not know (jsonkeep).
	jsonkeep.Unknown `json:"-"`
}

// PublishHistoryRetention stores retention as the agents' IP-history
// retention, written by node, unless etcd already holds that retention
// (written is then false and nothing changes). retention must not be
// negative.
func (s *Store) PublishHistoryRetention(ctx context.Context, retention time.Duration, node string) (written bool, err error) {
	if retention < 0 {
		return false, fmt.Errorf("history retention %s is negative", retention)
	}
	// An unreadable record (written by hand) is replaced.
	stored, cur, found, err := s.historySetting(ctx)
	switch {
	case err != nil && !errors.Is(err, errBadSetting):
		return false, err
	case err == nil && found && cur.Retention == retention:
		return false, nil
	}
	// Rewritten from the record read: what a newer version wrote stays.
	stored.Retention, stored.Node, stored.At = retention.String(), node, s.now().UTC()
	val, err := kvstore.EncodeJSON(stored)
	if err != nil {
		return false, err
	}
	if _, err := s.kv.Put(ctx, historySettingKey(), val); err != nil {
		return false, fmt.Errorf("put %s: %w", historySettingKey(), kvstore.Unavailable(err))
	}
	return true, nil
}

// errBadSetting marks a setting record that cannot be read back.
var errBadSetting = errors.New("unreadable setting")

// HistoryRetention reads the agents' IP-history retention; found is false
// when no agent has stored one yet. A record that cannot be read (written
// by hand) is an error.
func (s *Store) HistoryRetention(ctx context.Context) (h HistorySetting, found bool, err error) {
	_, h, found, err = s.historySetting(ctx)
	return h, found, err
}

// historySetting reads the setting as stored and as HistoryRetention
// gives it. A record it cannot read is errBadSetting, with what it
// decoded of it.
func (s *Store) historySetting(ctx context.Context) (stored historySettingJSON, h HistorySetting, found bool, err error) {
	v, err := kvstore.GetJSON[historySettingJSON](ctx, s.kv, historySettingKey())
	switch {
	case errors.Is(err, kvstore.ErrNotFound):
		return historySettingJSON{}, HistorySetting{}, false, nil
	case err != nil:
		if !errors.Is(err, retry.ErrUnavailable) {
			err = fmt.Errorf("%w: %w", errBadSetting, err)
		}
		return historySettingJSON{}, HistorySetting{}, false, err
	}
	d, err := time.ParseDuration(v.Value.Retention)
	if err != nil || d < 0 {
		return v.Value, HistorySetting{}, false, fmt.Errorf("%w: %s: retention %q", errBadSetting, historySettingKey(), v.Value.Retention)
	}
	return v.Value, HistorySetting{Retention: d, Node: v.Value.Node, At: v.Value.At}, true, nil
}
