// Package ociimage writes a container image as an OCI image archive (an
// OCI layout in a tar file) from files in memory, with go-containerregistry:
// one layer on an empty base, no daemon, no registry; Write writes one
// image, WriteIndex the images of several architectures under one OCI
// image index (a runtime takes the one of its own platform). It is
// reproducible: file times, owners and order are fixed, so the same files
// give the same digest and the same archive bytes.
package ociimage

import (
	"archive/tar"
	"bytes"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"sort"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// File is one file of the image: a path without a leading slash.
type File struct {
	Path string
	Data []byte
	Mode int64
}

// Spec is an image.
type Spec struct {
	Files      []File
	Entrypoint []string
	Env        []string
	// Ref is the reference the archive records (containerd's import
	// names the image after it). WriteIndex takes the index's.
	Ref string
	// Arch is the architecture (a GOARCH) of the image's binaries, which
	// its configuration and its index entry record; empty is amd64.
	Arch string
}

// epoch is every file's and the image's time.
var epoch = time.Unix(0, 0).UTC()

// Write writes s as an OCI archive at out and returns the image digest.
func Write(s Spec, out string) (v1.Hash, error) {
	img, err := image(s)
	if err != nil {
		return v1.Hash{}, err
	}
	digest, err := img.Digest()
	if err != nil {
		return v1.Hash{}, err
	}
	return digest, writeArchive(out, func(p layout.Path) error {
		return p.AppendImage(img, layout.WithAnnotations(refAnnotations(s.Ref)))
	})
}

// WriteIndex writes the images of specs, one per architecture, as one OCI
// image index named ref in an OCI archive at out, and returns the index's
// digest.
func WriteIndex(ref string, specs []Spec, out string) (v1.Hash, error) {
	idx := mutate.IndexMediaType(empty.Index, types.OCIImageIndex)
	seen := map[string]bool{}
	for _, s := range specs {
		arch := archOf(s)
		if seen[arch] {
			return v1.Hash{}, fmt.Errorf("two images for %s", arch)
		}
		seen[arch] = true
		img, err := image(s)
		if err != nil {
			return v1.Hash{}, fmt.Errorf("%s image: %w", arch, err)
		}
		idx = mutate.AppendManifests(idx, mutate.IndexAddendum{Add: img, Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: arch}}})
	}
	digest, err := idx.Digest()
	if err != nil {
		return v1.Hash{}, err
	}
	return digest, writeArchive(out, func(p layout.Path) error {
		return p.AppendIndex(idx, layout.WithAnnotations(refAnnotations(ref)))
	})
}

func archOf(s Spec) string {
	if s.Arch == "" {
		return "amd64"
	}
	return s.Arch
}

func refAnnotations(ref string) map[string]string {
	return map[string]string{
		"org.opencontainers.image.ref.name": ref,
		"io.containerd.image.name":          ref,
	}
}

// image is s as one layer on an empty base, at epoch.
func image(s Spec) (v1.Image, error) {
	files, modes := map[string][]byte{}, map[string]int64{}
	for _, f := range s.Files {
		files[f.Path], modes[f.Path] = f.Data, f.Mode
	}
	layerTar, err := tarFiles(files, modes)
	if err != nil {
		return nil, err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(layerTar)), nil })
	if err != nil {
		return nil, err
	}
	img, err := mutate.Append(empty.Image, mutate.Addendum{Layer: layer, History: v1.History{Created: v1.Time{Time: epoch}, CreatedBy: "ociimage"}})
	if err != nil {
		return nil, err
	}
	cfg, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cfg = cfg.DeepCopy()
	cfg.Architecture, cfg.OS = archOf(s), "linux"
	cfg.Created = v1.Time{Time: epoch}
	cfg.Config.Entrypoint, cfg.Config.Env = s.Entrypoint, s.Env
	if img, err = mutate.ConfigFile(img, cfg); err != nil {
		return nil, err
	}
	return mutate.CreatedAt(img, v1.Time{Time: epoch})
}

// writeArchive writes an OCI layout that add fills to a temporary
// directory and then as a tar at out.
func writeArchive(out string, add func(layout.Path) error) error {
	tmp, err := os.MkdirTemp("", "ociimage-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	p, err := layout.Write(tmp, empty.Index)
	if err != nil {
		return err
	}
	if err := add(p); err != nil {
		return fmt.Errorf("write layout: %w", err)
	}
	if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
		return err
	}
	return tarDir(tmp, out)
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
	// Close writes the last file's padding and the end-of-archive blocks:
	// the buffer is the archive only after it.
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
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
