package e2e

import (
	"context"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/invoke"
	"github.com/containernetworking/cni/pkg/types"
	"github.com/stretchr/testify/require"
)

// TestImportHostLocal: pods made by bridge with the real host-local, with
// pings running between them and to their gateway, are imported into
// kvipam (a dry run first writes nothing), the agent learns them, the
// conflist is switched to bridge with kvipam-ipam, and new pods get
// addresses that never collide with the imported ones (nor with
// host-local's gateway, reserved). Not one ping of the old pods is lost,
// old and new pods reach each other, kvipamctl check is clean, and
// host-local's files are untouched.
func TestImportHostLocal(t *testing.T) {
	r := newImportRig(t, "node-hl", 26)
	old := r.addOld("a", "b", "c")
	files := readDir(t, r.hostLocalDir())
	pings := []*pinger{
		startPinger(t, old[0].ns, old[1].addr, 20*time.Millisecond),
		startPinger(t, old[1].ns, old[2].addr, 20*time.Millisecond),
		startPinger(t, old[2].ns, importGateway, 20*time.Millisecond),
	}
	start := time.Now()
	for _, p := range pings {
		p.awaitAnswers(t, 10*time.Second, start, 3)
	}

	pl := r.importPlan()
	require.True(t, pl.DryRun)
	require.Len(t, pl.Blocks, 1, "%+v", pl)
	require.Equal(t, "claim", pl.Blocks[0].Action)
	require.Equal(t, r.n.name, pl.Blocks[0].Claimant)
	require.Len(t, pl.Blocks[0].New, 3)
	require.Empty(t, r.imported(), "a dry run writes nothing")

	r.ctlOK(r.importArgs()...)
	got := r.imported()
	require.Len(t, got, 3)
	for _, p := range old {
		al, ok := got[p.addr]
		require.True(t, ok, "%s imported", p.addr)
		require.Equal(t, p.rt.ContainerID, al.ContainerID)
		require.Equal(t, "eth0", al.IfName)
		require.Equal(t, r.n.name, al.Node)
		require.Equal(t, importNet, al.Network)
		require.Equal(t, r.source(), al.Imported)
		require.False(t, al.Borrowed)
	}
	r.awaitLearned(old...)

	// The switch: new pods through kvipam-ipam, in the imported block too.
	r.switchConflist()
	fresh := r.addNew("d", "e", "f", "g")
	seen := map[netip.Addr]string{importGateway: "host-local's gateway"}
	for _, p := range append(append([]addedPod{}, old...), fresh...) {
		require.NotContains(t, seen, p.addr, "%s given to %s and %s", p.addr, p.name, seen[p.addr])
		seen[p.addr] = p.name
	}
	require.NoError(t, ping(fresh[0].ns, old[0].addr), "new pod to old pod")
	require.NoError(t, ping(old[0].ns, fresh[0].addr), "old pod to new pod")

	out, err := r.ctl(nil, "check")
	require.NoError(t, err, "kvipamctl check:\n%s", out)
	status := r.ctlOK("import", "status")
	require.Contains(t, status, r.source())

	finish(pings...)
	for _, p := range pings {
		runs, sent := p.losses()
		require.Empty(t, runs, "pings to %s lost (%d sent)", p.dst, sent)
		require.Greater(t, sent, 10)
	}
	require.Equal(t, files, readDir(t, r.hostLocalDir()), "host-local's state untouched before finalize")
}

// TestImportedAddressFreedByOldPodsDel: after the import and the switch,
// CNI GC keeps the imported address of every container the runtime
// lists and frees the one of a container it does not; an old pod's DEL
// (through the switched conflist: bridge, then kvipam-ipam) frees exactly
// its imported address, though the agent has no endpoint of it, and so
// does one through the network switched to kvipam (bridge's veth is not
// the plugin's); once every old pod is gone no imported record is left,
// and the new pods keep theirs. Finalize then drops the marks and, with
// --dir, host-local's files of the imported addresses.
func TestImportedAddressFreedByOldPodsDel(t *testing.T) {
	r := newImportRig(t, "node-del", 26)
	old := r.addOld("a", "b", "c", "z")
	r.ctlOK(r.importArgs()...)
	r.awaitLearned(old...)
	r.switchConflist()
	fresh := r.addNew("d")

	// CNI GC (kvipam-ipam's, as a main plugin that forwards GC calls
	// it) keeps the imported address of every container the runtime
	// lists, and frees the one of a container it no longer lists (z's).
	var valid []types.GCAttachment
	for _, p := range append(append([]addedPod{}, old[:3]...), fresh...) {
		valid = append(valid, types.GCAttachment{ContainerID: p.rt.ContainerID, IfName: "eth0"})
	}
	gc, err := libcni.InjectConf(r.kv.Plugins[0], map[string]any{"name": importNet, "cniVersion": r.kv.CNIVersion, "cni.dev/valid-attachments": valid})
	require.NoError(t, err)
	require.NoError(t, r.n.do(func() error {
		return invoke.ExecPluginWithoutResult(context.Background(), r.n.bin+"/kvipam-ipam", gc.Bytes, &invoke.Args{Command: "GC", Path: r.n.bin}, nil)
	}))
	got := r.imported()
	require.NotContains(t, got, old[3].addr, "GC freed the address of a container the runtime no longer lists")
	require.Len(t, got, 3, "and kept every running container's")
	old = old[:3]

	require.NoError(t, r.n.del(r.kv, old[0].pod))
	got = r.imported()
	require.NotContains(t, got, old[0].addr, "the old pod's DEL freed its address")
	require.Len(t, got, 2, "and only its")
	require.Len(t, r.n.ipKeys(fresh[0].rt.ContainerID), 1)
	require.NoError(t, r.n.del(r.kv, old[0].pod), "a second DEL succeeds")

	// The network switched to kvipam itself (the datapath changes for new
	// pods): an old pod's DEL frees its address, though the plugin finds
	// no veth of its own (the pod's port is the bridge's).
	kvipamNet := r.n.kvipamList(importNet, "1.1.0", `,"pool":"`+importPool+`"`)
	require.NoError(t, r.n.del(kvipamNet, old[2].pod))
	require.NotContains(t, r.imported(), old[2].addr, "freed by the DEL through kvipam")
	require.Len(t, r.imported(), 1)
	require.NoError(t, r.n.del(kvipamNet, old[2].pod), "a second DEL succeeds")

	require.NoError(t, r.n.del(r.kv, old[1].pod))
	require.Empty(t, r.imported(), "no imported record left once every old pod is gone")
	require.Len(t, r.n.ipKeys(fresh[0].rt.ContainerID), 1, "the new pod keeps its address")
	// The freed addresses are the pool's again.
	again := r.addNew("h", "i", "j", "k")
	require.NotEqual(t, again[0].addr, fresh[0].addr)

	out, err := r.ctl(nil, "check")
	require.NoError(t, err, "kvipamctl check:\n%s", out)
	r.ctlOK("import", "finalize", r.source(), "--dir", r.hostLocalDir())
	for _, p := range old {
		_, err := os.Stat(filepath.Join(r.hostLocalDir(), p.addr.String()))
		require.ErrorIs(t, err, os.ErrNotExist, "finalize --dir removed host-local's file of %s", p.addr)
	}
	status := r.ctlOK("import", "status", "-o", "json")
	require.Contains(t, status, `"finalized": true`)
}

// TestImportRefusesConflict: an address kvipam already gives to another
// owner refuses the import of its whole block, naming both owners, and
// nothing of that block is written; the import exits non-zero.
func TestImportRefusesConflict(t *testing.T) {
	r := newImportRig(t, "node-cf", 26)
	old := r.addOld("a", "b")
	r.switchConflist()
	// kvipam gives b's address to another attachment (a static request).
	other := r.addNewStatic("x", old[1].addr)
	out, err := r.ctl(nil, r.importArgs()...)
	require.Error(t, err, "the import is refused:\n%s", out)
	require.Contains(t, out, other.rt.ContainerID+"/eth0", "names kvipam's owner")
	require.Contains(t, out, old[1].rt.ContainerID+"/eth0", "names the source's owner")
	require.Empty(t, r.imported(), "nothing of the block written")
	require.Empty(t, r.n.ipKeys(old[0].rt.ContainerID), "not even a's, in the same block")
}

// TestImportIdempotentAndResumable: the import stopped before and after
// each block's transaction (a kill there), and killed at once while it
// writes, always leaves each block all imported or not at all; run again
// it converges to the one result, and a run over a finished import
// writes nothing.
func TestImportIdempotentAndResumable(t *testing.T) {
	r := newImportRig(t, "node-rs", 29)
	var names []string
	for i := range 16 {
		names = append(names, "p"+string(rune('a'+i)))
	}
	old := r.addOld(names...)
	blocks := map[netip.Prefix][]addedPod{}
	for _, p := range old {
		b := netip.PrefixFrom(p.addr, 29).Masked()
		blocks[b] = append(blocks[b], p)
	}
	require.GreaterOrEqual(t, len(blocks), 3, "the pods span blocks")
	whole := func(when string) {
		t.Helper()
		claimed := r.claims()
		got := r.imported()
		for b, ps := range blocks {
			n := 0
			for _, p := range ps {
				if al, ok := got[p.addr]; ok {
					require.Equal(t, p.rt.ContainerID, al.ContainerID)
					n++
				}
			}
			require.True(t, n == 0 || n == len(ps), "%s: block %s half imported: %d of %d", when, b, n, len(ps))
			require.Equal(t, n > 0, claimed[b], "%s: block %s claimed with its records, not apart", when, b)
		}
	}
	stopped := func(fault string) {
		t.Helper()
		out, err := r.ctl([]string{"KVIPAM_IMPORT_FAULT=" + fault}, r.importArgs()...)
		require.Error(t, err, out)
		require.Contains(t, out, "import stopped by KVIPAM_IMPORT_FAULT")
		whole(fault)
	}
	stopped("before:1") // nothing written
	require.Empty(t, r.imported())
	stopped("before:2") // the first block written, stopped before the second
	stopped("after:1")  // resumed: the second block, stopped as its answer came
	require.Less(t, len(r.imported()), len(old))
	// SIGKILLed while it runs, wherever that lands (the assertion holds
	// whenever it does).
	for _, after := range []time.Duration{0, 5 * time.Millisecond, 20 * time.Millisecond, 50 * time.Millisecond} {
		cmd := exec.Command(filepath.Join(r.n.bin, "kvipamctl"), append(r.importArgs(), "--endpoints", r.n.etcdEndpoint())...)
		require.NoError(t, startIn(r.n.host, cmd))
		time.Sleep(after)
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		whole("killed after " + after.String())
	}
	out := r.ctlOK(append(r.importArgs(), "-o", "json")...)
	require.Len(t, r.imported(), len(old), out)
	whole("finished")
	r.awaitLearned(old...)
	pl := r.importPlan()
	for _, b := range pl.Blocks {
		require.Equal(t, "done", b.Action, "%+v", pl)
	}
	out = r.ctlOK(append(r.importArgs(), "-o", "json")...)
	require.True(t, strings.Contains(out, `"written": 0`), "a finished import writes nothing again:\n%s", out)
	out, err := r.ctl(nil, "check")
	require.NoError(t, err, "kvipamctl check:\n%s", out)
}

// readDir reads every file of dir, by name.
func readDir(t *testing.T, dir string) map[string]string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	require.NoError(t, err)
	out := map[string]string{}
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join(dir, e.Name()))
		require.NoError(t, err)
		out[e.Name()] = string(b)
	}
	return out
}
