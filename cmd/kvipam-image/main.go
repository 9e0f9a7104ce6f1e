// Command kvipam-image builds kvipam's container image as an OCI image
// archive (an OCI layout in a tar file), with no daemon and no registry:
// one OCI image index holding an image per architecture (amd64 and arm64
// by default, cross-compiled with CGO_ENABLED=0), each with static binaries
// (kvipam-agent, kvipam, kvipam-ipam, kvipamctl, and the reference
// loopback, portmap and bandwidth plugins: loopback because containerd's
// CRI needs it, bandwidth because the default conflist chains it, portmap
// because the routes datapath's conflist does)
// and the default conflist on an empty base, no shell. It is reproducible:
// file times, owners and order are fixed and the binaries are built with
// -trimpath and no build ID, so the same commit gives the same digest.
// `make image` runs it with the build's version as the tag, and renders
// the DaemonSet manifest naming that image.
package main

import (
	"flag"
	"fmt"
	"os"
	"strings"
)

func main() {
	var o options
	var archs string
	flag.StringVar(&o.out, "out", "bin/kvipam-image.tar", "the OCI archive to write")
	flag.StringVar(&o.ref, "ref", "", "the image reference recorded in the archive, tagged with the build's version (make image: ghcr.io/kvipam/kvipam:$(git describe --always --dirty)); required")
	flag.StringVar(&archs, "arch", strings.Join(defaultArchs, ","), "the architectures (GOARCH) of the index's images, comma separated")
	flag.StringVar(&o.conflist, "conflist", "deploy/cni/10-kvipam.conflist", "the conflist the image carries at /etc/kvipam/10-kvipam.conflist")
	flag.StringVar(&o.ldflags, "ldflags", "", "extra -ldflags for the binaries (make image passes the version and commit, as make build does)")
	var manifests string
	flag.StringVar(&manifests, "manifests", "", "Kubernetes manifests, comma separated, to render into --manifest-dir with their images of the --ref repository replaced by --ref")
	flag.StringVar(&o.manifestDir, "manifest-dir", "bin", "where --manifests are rendered (the same file names)")
	flag.Parse()
	if o.ref == "" {
		fmt.Fprintln(os.Stderr, "kvipam-image: --ref is required (a tag naming the build, never one reused across builds)")
		os.Exit(2)
	}
	for _, m := range strings.Split(manifests, ",") {
		if m = strings.TrimSpace(m); m != "" {
			o.manifests = append(o.manifests, m)
		}
	}
	for _, a := range strings.Split(archs, ",") {
		if a = strings.TrimSpace(a); a != "" {
			o.archs = append(o.archs, a)
		}
	}
	o.progress = os.Stderr
	b, err := build(o)
	if err != nil {
		fmt.Fprintf(os.Stderr, "kvipam-image: %v\n", err)
		os.Exit(1)
	}
	fmt.Printf("%s %s %s\n", o.out, o.ref, b.digest)
}
