package delqueue

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/agent/api"
)

func owner(id, ifName string) api.Owner { return api.Owner{ContainerID: id, IfName: ifName} }

func files(t *testing.T, dir string) []string {
	t.Helper()
	des, err := os.ReadDir(dir)
	require.NoError(t, err)
	var out []string
	for _, de := range des {
		out = append(out, de.Name())
	}
	return out
}

func TestEnqueueCollapsesRepeatsOfAnAttachment(t *testing.T) {
	dir := t.TempDir()
	require.NoError(t, Enqueue(dir, owner("c1", "eth0")))
	require.NoError(t, Enqueue(dir, owner("c1", "eth0")))
	require.NoError(t, Enqueue(dir, owner("c1", "net1")))
	require.NoError(t, Enqueue(dir, api.Owner{ContainerID: "c2", IfName: "eth0", Namespace: "ns", Pod: "p"}))

	got := files(t, dir)
	require.Len(t, got, 3, "one file per (container ID, ifname), no temporary files left: %v", got)
	for _, f := range got {
		require.False(t, strings.HasPrefix(f, "."), "leftover temporary file %s", f)
	}
	entries, err := List(dir)
	require.NoError(t, err)
	var keys []string
	for _, e := range entries {
		require.False(t, e.QueuedAt.IsZero())
		keys = append(keys, e.Owner.Key())
	}
	slices.Sort(keys)
	require.Equal(t, []string{"c1/eth0", "c1/net1", "c2/eth0"}, keys)
}

func TestEnqueueRefusesAnIncompleteOwner(t *testing.T) {
	for _, o := range []api.Owner{owner("", "eth0"), owner("c1", "")} {
		require.Error(t, Enqueue(t.TempDir(), o))
	}
}

func TestEnqueueCreatesTheDirectory(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "a", "b")
	require.NoError(t, Enqueue(dir, owner("c1", "eth0")))
	require.Len(t, files(t, dir), 1)
}

func TestDrain(t *testing.T) {
	tests := []struct {
		name     string
		queued   []api.Owner
		fail     map[string]bool // container IDs whose release fails
		wantDone int
		wantLeft []string
		wantErr  string
	}{
		{name: "empty", wantDone: 0},
		{name: "all released", queued: []api.Owner{owner("a", "eth0"), owner("b", "eth0")}, wantDone: 2},
		{
			name: "a failed release stays queued", queued: []api.Owner{owner("a", "eth0"), owner("b", "eth0"), owner("c", "eth0")},
			fail: map[string]bool{"b": true}, wantDone: 2, wantLeft: []string{"b"}, wantErr: "release queued b/eth0: agent said no",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			for _, o := range tt.queued {
				require.NoError(t, Enqueue(dir, o))
			}
			var released []string
			done, err := Drain(context.Background(), dir, func(_ context.Context, o api.Owner) error {
				if tt.fail[o.ContainerID] {
					return errors.New("agent said no")
				}
				released = append(released, o.ContainerID)
				return nil
			})
			require.Equal(t, tt.wantDone, done)
			require.Len(t, released, tt.wantDone)
			if tt.wantErr == "" {
				require.NoError(t, err)
			} else {
				require.ErrorContains(t, err, tt.wantErr)
			}
			left, err := List(dir)
			require.NoError(t, err)
			var ids []string
			for _, e := range left {
				ids = append(ids, e.Owner.ContainerID)
			}
			require.Equal(t, tt.wantLeft, ids)
			for _, f := range files(t, dir) {
				require.False(t, strings.HasPrefix(f, "."), "a failed entry goes back under its own name, found %s", f)
			}
		})
	}
}

func TestDrainOfAMissingDirectoryIsEmpty(t *testing.T) {
	done, err := Drain(context.Background(), filepath.Join(t.TempDir(), "none"), func(context.Context, api.Owner) error {
		t.Fatal("nothing to release")
		return nil
	})
	require.NoError(t, err)
	require.Zero(t, done)
}

func TestDrainKeepsADelQueuedDuringTheRelease(t *testing.T) {
	for _, fail := range []bool{false, true} {
		dir := t.TempDir()
		require.NoError(t, Enqueue(dir, owner("a", "eth0")))
		var first Entry
		_, err := DrainEntries(context.Background(), dir, func(_ context.Context, e Entry) error {
			first = e
			// A plugin queues the same owner again while the agent releases.
			require.NoError(t, Enqueue(dir, e.Owner))
			if fail {
				return errors.New("etcd unavailable")
			}
			return nil
		})
		require.Equal(t, fail, err != nil)
		left, err := List(dir)
		require.NoError(t, err)
		require.Len(t, left, 1, "the newer DEL stays queued (release failed: %v)", fail)
		require.True(t, left[0].QueuedAt.After(first.QueuedAt) || left[0].QueuedAt.Equal(first.QueuedAt))
		require.Len(t, files(t, dir), 1)
	}
}

func TestDrainFinishesWhatAKilledDrainClaimed(t *testing.T) {
	dir := t.TempDir()
	require.NoError(t, Enqueue(dir, owner("a", "eth0")))
	name := FileName(owner("a", "eth0"))
	require.NoError(t, os.Rename(filepath.Join(dir, name), filepath.Join(dir, claimPrefix+name)))

	var got []string
	done, err := Drain(context.Background(), dir, func(_ context.Context, o api.Owner) error {
		got = append(got, o.ContainerID)
		return nil
	})
	require.NoError(t, err)
	require.Equal(t, 1, done)
	require.Equal(t, []string{"a"}, got)
	require.Empty(t, files(t, dir))
}

func TestDrainReportsAndKeepsACorruptEntry(t *testing.T) {
	dir := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(dir, "garbage.json"), []byte("{not json"), 0o600))
	require.NoError(t, Enqueue(dir, owner("a", "eth0")))
	done, err := Drain(context.Background(), dir, func(context.Context, api.Owner) error { return nil })
	require.Equal(t, 1, done)
	require.ErrorContains(t, err, "garbage.json")
	require.Equal(t, []string{RejectedDir}, files(t, dir), "kept aside, out of the queue")
}

func TestDrainStopsWhenTheContextEnds(t *testing.T) {
	dir := t.TempDir()
	require.NoError(t, Enqueue(dir, owner("a", "eth0")))
	require.NoError(t, Enqueue(dir, owner("b", "eth0")))
	ctx, cancel := context.WithCancel(context.Background())
	calls := 0
	done, err := Drain(ctx, dir, func(context.Context, api.Owner) error {
		calls++
		cancel()
		return nil
	})
	require.ErrorIs(t, err, context.Canceled)
	require.Equal(t, 1, calls)
	require.Equal(t, 1, done)
	left, _ := List(dir)
	require.Len(t, left, 1)
}

func TestFileNameIsStableAndDistinct(t *testing.T) {
	a := FileName(owner("c1", "eth0"))
	require.Equal(t, a, FileName(api.Owner{ContainerID: "c1", IfName: "eth0", Pod: "other"}))
	require.NotEqual(t, a, FileName(owner("c1", "eth1")))
	require.True(t, strings.HasSuffix(a, ".json"))
}

// TestMalformedDelQueueEntryRejectedOnce: an entry no Drain can ever read
// is moved to the rejected directory and reported by one Drain only, so
// the agent's queue watcher, which drains while Pending says yes, does
// not retry and warn about it every second forever.
func TestMalformedDelQueueEntryRejectedOnce(t *testing.T) {
	for _, tt := range []struct{ name, file, data string }{
		{name: "not json", file: "garbage.json", data: "{not json"},
		{name: "no owner", file: "empty.json", data: `{"owner":{"containerID":"c1"}}`},
		{name: "claimed by a killed drain", file: claimPrefix + "garbage.json", data: "{not json"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			require.NoError(t, os.WriteFile(filepath.Join(dir, tt.file), []byte(tt.data), 0o600))
			require.NoError(t, Enqueue(dir, owner("a", "eth0")))
			release := func(context.Context, api.Owner) error { return nil }

			done, err := Drain(context.Background(), dir, release)
			require.Equal(t, 1, done, "the good entry is applied")
			require.ErrorIs(t, err, ErrRejected)
			require.ErrorContains(t, err, strings.TrimPrefix(tt.file, claimPrefix))

			pending, err := Pending(dir)
			require.NoError(t, err)
			require.False(t, pending, "a rejected entry is not pending")
			done, err = Drain(context.Background(), dir, release)
			require.NoError(t, err, "a rejected entry is reported once")
			require.Zero(t, done)

			rejected := files(t, filepath.Join(dir, RejectedDir))
			require.Equal(t, []string{strings.TrimPrefix(tt.file, claimPrefix)}, rejected)
			data, err := os.ReadFile(filepath.Join(dir, RejectedDir, rejected[0]))
			require.NoError(t, err)
			require.Equal(t, tt.data, string(data), "kept as it was, for a person to read")
		})
	}
}
