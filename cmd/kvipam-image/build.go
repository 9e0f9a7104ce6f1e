package main

import (
	"archive/tar"
	"bytes"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"sort"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

type options struct {
	out, ref, conflist string
}

// binaries are the image's programs: go build targets, in /usr/local/bin.
var binaries = []string{
	"github.com/kvipam/kvipam/cmd/kvipam-agent",
	"github.com/kvipam/kvipam/cmd/kvipam",
	"github.com/kvipam/kvipam/cmd/kvipam-ipam",
	"github.com/kvipam/kvipam/cmd/kvipamctl",
	"github.com/containernetworking/plugins/plugins/main/loopback",
}

// epoch is every file's and the image's time: a fixed one, so that the
// same sources give the same bytes.
var epoch = time.Unix(0, 0).UTC()

func build(o options) (v1.Hash, error) {
	tmp, err := os.MkdirTemp("", "kvipam-image-")
	if err != nil {
		return v1.Hash{}, err
	}
	defer os.RemoveAll(tmp)
	files := map[string][]byte{} // path in the image -> content
	modes := map[string]int64{}
	args := append([]string{"build", "-trimpath", "-ldflags", "-s -w -buildid=", "-o", tmp + "/"}, binaries...)
	cmd := exec.Command("go", args...)
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux")
	if out, err := cmd.CombinedOutput(); err != nil {
		return v1.Hash{}, fmt.Errorf("go build: %w\n%s", err, out)
	}
	for _, b := range binaries {
		name := path.Base(b)
		data, err := os.ReadFile(filepath.Join(tmp, name))
		if err != nil {
			return v1.Hash{}, err
		}
		files["usr/local/bin/"+name], modes["usr/local/bin/"+name] = data, 0o755
	}
	conf, err := os.ReadFile(o.conflist)
	if err != nil {
		return v1.Hash{}, err
	}
	files["etc/kvipam/10-kvipam.conflist"], modes["etc/kvipam/10-kvipam.conflist"] = conf, 0o644

	layerTar, err := tarFiles(files, modes)
	if err != nil {
		return v1.Hash{}, err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(layerTar)), nil })
	if err != nil {
		return v1.Hash{}, err
	}
	img, err := mutate.Append(empty.Image, mutate.Addendum{Layer: layer, History: v1.History{Created: v1.Time{Time: epoch}, CreatedBy: "kvipam-image"}})
	if err != nil {
		return v1.Hash{}, err
	}
	cfg, err := img.ConfigFile()
	if err != nil {
		return v1.Hash{}, err
	}
	cfg = cfg.DeepCopy()
	cfg.Architecture, cfg.OS = "amd64", "linux"
	cfg.Created = v1.Time{Time: epoch}
	cfg.Config.Entrypoint = []string{"/usr/local/bin/kvipam-agent"}
	cfg.Config.Env = []string{"PATH=/usr/local/bin"}
	img, err = mutate.ConfigFile(img, cfg)
	if err != nil {
		return v1.Hash{}, err
	}
	if img, err = mutate.CreatedAt(img, v1.Time{Time: epoch}); err != nil {
		return v1.Hash{}, err
	}
	digest, err := img.Digest()
	if err != nil {
		return v1.Hash{}, err
	}

	dir := filepath.Join(tmp, "oci")
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		return v1.Hash{}, err
	}
	if err := p.AppendImage(img, layout.WithAnnotations(map[string]string{
		"org.opencontainers.image.ref.name": o.ref,
		"io.containerd.image.name":          o.ref,
	})); err != nil {
		return v1.Hash{}, err
	}
	if err := os.MkdirAll(filepath.Dir(o.out), 0o755); err != nil {
		return v1.Hash{}, err
	}
	if err := tarDir(dir, o.out); err != nil {
		return v1.Hash{}, err
	}
	return digest, nil
}

// tarFiles is a tar of files (with their parent directories), in name
// order, owned by root, at epoch.
func tarFiles(files map[string][]byte, modes map[string]int64) ([]byte, error) {
	names := make([]string, 0, len(files))
	dirs := map[string]bool{}
	for n := range files {
		names = append(names, n)
		for d := path.Dir(n); d != "."; d = path.Dir(d) {
			dirs[d] = true
		}
	}
	for d := range dirs {
		names = append(names, d+"/")
	}
	sort.Strings(names)
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, n := range names {
		h := &tar.Header{Name: n, ModTime: epoch, Uname: "root", Gname: "root", Format: tar.FormatPAX}
		if data, ok := files[n]; ok {
			h.Typeflag, h.Mode, h.Size = tar.TypeReg, modes[n], int64(len(data))
			if err := tw.WriteHeader(h); err != nil {
				return nil, err
			}
			if _, err := tw.Write(data); err != nil {
				return nil, err
			}
			continue
		}
		h.Typeflag, h.Mode = tar.TypeDir, 0o755
		if err := tw.WriteHeader(h); err != nil {
			return nil, err
		}
	}
	return buf.Bytes(), tw.Close()
}

// tarDir writes dir's tree to out as a tar, in name order, at epoch.
func tarDir(dir, out string) error {
	var names []string
	if err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || p == dir {
			return err
		}
		names = append(names, p)
		return nil
	}); err != nil {
		return err
	}
	sort.Strings(names)
	f, err := os.Create(out)
	if err != nil {
		return err
	}
	tw := tar.NewWriter(f)
	for _, p := range names {
		rel, _ := filepath.Rel(dir, p)
		st, err := os.Stat(p)
		if err != nil {
			return err
		}
		h := &tar.Header{Name: filepath.ToSlash(rel), ModTime: epoch, Mode: 0o644, Format: tar.FormatPAX}
		if st.IsDir() {
			h.Typeflag, h.Name, h.Mode = tar.TypeDir, h.Name+"/", 0o755
			if err := tw.WriteHeader(h); err != nil {
				return err
			}
			continue
		}
		data, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		h.Typeflag, h.Size = tar.TypeReg, int64(len(data))
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		if _, err := tw.Write(data); err != nil {
			return err
		}
	}
	if err := tw.Close(); err != nil {
		return err
	}
	if err := f.Sync(); err != nil {
		return err
	}
	return f.Close()
}
