package main

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/kvipam/kvipam/internal/tools/ociimage"
)

type options struct {
	out, ref, conflist string
	// ldflags are added to the binaries' -ldflags (the version and
	// commit of internal/foundation/buildinfo).
	ldflags string
	// archs are the GOARCHes of the index's images.
	archs []string
	// manifests are rendered into manifestDir (same base names) with
	// every image of ref's repository replaced by ref.
	manifests   []string
	manifestDir string
	// progress, if set, hears what is being built and each package as go
	// build compiles it (go build -v): minutes on a cold machine.
	progress io.Writer
}

// binaries are the image's programs: go build targets, in /usr/local/bin.
// Besides kvipam's own: the reference loopback plugin (containerd's CRI
// adds a loopback network to every pod) and the plugins the example
// conflists chain after kvipam, portmap (hostPort, on the routes datapath:
// with eBPF kvipam serves host ports itself) and bandwidth (the
// kubernetes.io/*-bandwidth annotations), from containernetworking/plugins
// at the version go.mod pins. install-cni installs every plugin a conflist
// chains (TestImageInstallsChainedPlugins).
var binaries = []string{
	"github.com/kvipam/kvipam/cmd/kvipam-agent",
	"github.com/kvipam/kvipam/cmd/kvipam",
	"github.com/kvipam/kvipam/cmd/kvipam-ipam",
	"github.com/kvipam/kvipam/cmd/kvipamctl",
	"github.com/containernetworking/plugins/plugins/main/loopback",
	"github.com/containernetworking/plugins/plugins/meta/portmap",
	"github.com/containernetworking/plugins/plugins/meta/bandwidth",
}

// defaultArchs are the architectures make image builds.
var defaultArchs = []string{"amd64", "arm64"}

// built is what build wrote: the index digest and each architecture's
// image files.
type built struct {
	digest v1.Hash
	files  map[string][]ociimage.File
}

func build(o options) (built, error) {
	archs := o.archs
	if len(archs) == 0 {
		archs = defaultArchs
	}
	conf, err := os.ReadFile(o.conflist)
	if err != nil {
		return built{}, err
	}
	tmp, err := os.MkdirTemp("", "kvipam-image-")
	if err != nil {
		return built{}, err
	}
	defer os.RemoveAll(tmp)
	b := built{files: map[string][]ociimage.File{}}
	var specs []ociimage.Spec
	for _, arch := range archs {
		dir := filepath.Join(tmp, arch)
		args := []string{"build", "-trimpath", "-ldflags", strings.TrimSpace("-s -w -buildid= " + o.ldflags), "-o", dir + "/"}
		if o.progress != nil {
			args = append(args, "-v")
			fmt.Fprintf(o.progress, "kvipam-image: building linux/%s (a cold machine compiles the standard library and every module for it first: minutes; go build -v names each package)\n", arch)
		}
		cmd := exec.Command("go", append(args, binaries...)...)
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH="+arch)
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		if o.progress != nil {
			cmd.Stdout, cmd.Stderr = io.MultiWriter(&out, o.progress), io.MultiWriter(&out, o.progress)
		}
		start := time.Now()
		if err := cmd.Run(); err != nil {
			return built{}, fmt.Errorf("go build (%s): %w\n%s", arch, err, out.Bytes())
		}
		if o.progress != nil {
			fmt.Fprintf(o.progress, "kvipam-image: linux/%s built in %s\n", arch, time.Since(start).Round(time.Second))
		}
		spec := ociimage.Spec{Arch: arch, Entrypoint: []string{"/usr/local/bin/kvipam-agent"}, Env: []string{"PATH=/usr/local/bin"}}
		for _, bin := range binaries {
			name := path.Base(bin)
			data, err := os.ReadFile(filepath.Join(dir, name))
			if err != nil {
				return built{}, err
			}
			spec.Files = append(spec.Files, ociimage.File{Path: "usr/local/bin/" + name, Data: data, Mode: 0o755})
		}
		spec.Files = append(spec.Files, ociimage.File{Path: "etc/kvipam/10-kvipam.conflist", Data: conf, Mode: 0o644})
		specs = append(specs, spec)
		b.files[arch] = spec.Files
	}
	if b.digest, err = ociimage.WriteIndex(o.ref, specs, o.out); err != nil {
		return built{}, err
	}
	for _, m := range o.manifests {
		if err := renderManifest(m, filepath.Join(o.manifestDir, filepath.Base(m)), o.ref); err != nil {
			return built{}, err
		}
	}
	return b, nil
}
