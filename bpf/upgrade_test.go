//go:build linux

package bpf

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/internal/testsupport/releasetest"
)

// releaseSpec is the program of a recorded release (RELEASES), read from
// git: the object file committed at the release's commit.
func releaseSpec(tb testing.TB, version string) *ebpf.CollectionSpec {
	tb.Helper()
	root, err := releasetest.RepoRoot()
	require.NoError(tb, err)
	rel, err := releasetest.Lookup(root, version)
	require.NoError(tb, err)
	out, err := exec.Command("git", "-C", root, "show", rel.Commit+":bpf/kvipam_bpfel.o").Output()
	require.NoError(tb, err, "read %s's program from git (a shallow clone needs git fetch --unshallow)", version)
	spec, err := ebpf.LoadCollectionSpecFromReader(bytes.NewReader(out))
	require.NoError(tb, err)
	return spec
}

// TestUpgradeOverReleasePins: an agent of this version starts over the pins
// that v0.1.0 left (its three maps, its program on a pinned TCX link, no
// announcement maps). Open keeps the old maps with their entries and
// creates the new ones, Adopt swaps the program in place, enforcement
// goes on, and a watched endpoint's announcements are reported.
func TestUpgradeOverReleasePins(t *testing.T) {
	requireDatapath(t)
	old := releaseSpec(t, "v0.1.0")
	require.NotContains(t, old.Maps, "kvipam_watch", "v0.1.0 has no announcement maps: this test plays an upgrade")
	h := newHost(t)
	p := h.addPod(t, 1)
	dir := pinDir(t)

	// What v0.1.0 leaves: this version's Attach writes the same entries in
	// the same three maps; its program is then put back on the link, and
	// the maps v0.1.0 does not know are unpinned.
	d := openDatapath(t, dir)
	h.attach(t, d, p.ep)
	require.NoError(t, d.Close())
	for _, name := range []string{"kvipam_watch", "kvipam_announce"} {
		require.NoError(t, os.Remove(filepath.Join(dir, name)))
	}
	var objs struct {
		Prog *ebpf.Program `ebpf:"kvipam_ingress"`
	}
	require.NoError(t, old.LoadAndAssign(&objs, &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: dir}}))
	l, err := link.LoadPinnedLink(d.linkPin(p.ep.HostIfIndex), nil)
	require.NoError(t, err)
	require.NoError(t, l.Update(objs.Prog))
	oldInfo, err := objs.Prog.Info()
	require.NoError(t, err)
	oldID, _ := oldInfo.ID()
	require.NoError(t, l.Close())
	require.NoError(t, objs.Prog.Close())
	require.Equal(t, []ebpf.ProgramID{oldID}, h.tcx(t, p.ep.HostIfIndex).programs, "v0.1.0's program runs")

	d2 := openDatapath(t, dir)
	require.FileExists(t, filepath.Join(dir, "kvipam_watch"))
	require.FileExists(t, filepath.Join(dir, "kvipam_announce"))
	want, err := p.ep.normalize()
	require.NoError(t, err)
	require.Equal(t, []Endpoint{want}, h.adopt(t, d2), "the endpoint v0.1.0 attached is adopted")
	require.Equal(t, []ebpf.ProgramID{d2.progID}, h.tcx(t, p.ep.HostIfIndex).programs, "swapped in place")

	before := counters(t, d2, p.ep.ID)
	p.sendFrame(t, arpFrame(broadcast, p.mac, spoof4, spoof4))
	awaitVerdict(t, d2, p, before, true)

	events := announcements(t, d2)
	require.NoError(t, d2.WatchAnnouncements(p.ep.HostIfIndex))
	before = counters(t, d2, p.ep.ID)
	p.sendFrame(t, arpFrame(broadcast, p.mac, p.v4, p.v4))
	awaitVerdict(t, d2, p, before, false)
	require.Equal(t, Announcement{HostIfIndex: p.ep.HostIfIndex, Kind: AnnounceGARP, Addr: p.v4, MAC: p.mac},
		nextAnnouncement(t, events))
}
