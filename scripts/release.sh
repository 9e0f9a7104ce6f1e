#!/usr/bin/env bash
# Builds a kvipam release into bin/release/$VERSION/ (docs/releasing.md):
#
#   <cmd>-linux-<arch>      each released command, static (CGO off),
#                           -trimpath, stamped with VERSION and COMMIT
#   kvipam-image.tar        the multi-arch OCI image archive (make image),
#                           tagged ghcr.io/kvipam/kvipam:$VERSION
#   kvipam-agent.yaml,      the DaemonSet and uninstall manifests, naming
#   kvipam-uninstall.yaml   that image (make image renders them)
#   SHA256SUMS              sha256sum of every file above (sha256sum -c)
#
# Run it as `make release VERSION=v1.2.3`: the Makefile passes VERSION,
# COMMIT, LDFLAGS (the -X flags of internal/foundation/buildinfo, the same
# as make build's), GO and MAKE in the environment.
#
# It refuses a VERSION that is not vMAJOR.MINOR.PATCH or
# vMAJOR.MINOR.PATCH-rc.N, a tree with changes or untracked files, a COMMIT
# other than HEAD, a VERSION without its CHANGELOG.md section, and an
# output directory that already exists (a release is never overwritten).
#
# For tests only, these narrow the build (make release builds everything):
#   RELEASE_ARCHS="amd64"        the GOARCHes (default: amd64 arm64)
#   RELEASE_CMDS="kvipam-agent"  the commands (default: all released ones)
#   RELEASE_IMAGE=0              no image archive or manifests
#   RELEASE_OUT=/tmp/x           the output directory
#   RELEASE_TRIAL=1              allow a dirty tree and a VERSION with no
#                                CHANGELOG.md section (never for a release)
set -euo pipefail
cd "$(dirname "$0")/.."

die() { echo "release: $*" >&2; exit 1; }

# The commands a release ships: the agent, the CNI plugins, the operator's
# tool and the demo. kvipam-image and kvipam-benchreport are build tools.
default_cmds="kvipam-agent kvipam kvipam-ipam kvipamctl kvipam-demo"

VERSION=${VERSION:-}
GO=${GO:-go}
MAKE=${MAKE:-make}
archs=${RELEASE_ARCHS:-amd64 arm64}
cmds=${RELEASE_CMDS:-$default_cmds}
image=${RELEASE_IMAGE:-1}
trial=${RELEASE_TRIAL:-0}
out=${RELEASE_OUT:-bin/release/$VERSION}

# 1. The version: semver with a leading v, a release candidate at most.
semver='^v(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)(-rc\.(0|[1-9][0-9]*))?$'
[[ $VERSION =~ $semver ]] ||
	die "VERSION \"$VERSION\" is not a release version: use make release VERSION=vMAJOR.MINOR.PATCH (or vMAJOR.MINOR.PATCH-rc.N), e.g. VERSION=v0.1.0; see docs/releasing.md"
[ -n "${LDFLAGS:-}" ] || die "LDFLAGS is empty: run this as make release VERSION=$VERSION"

# 2. The tree: exactly the commit the binaries will name.
command -v git >/dev/null || die "git is needed (the release names its commit)"
head=$(git rev-parse HEAD)
COMMIT=${COMMIT:-$head}
[ "$COMMIT" = "$head" ] || die "COMMIT=$COMMIT is not HEAD ($head): a release is built from the commit it names"
if [ "$trial" != 1 ]; then
	dirty=$(git status --porcelain --untracked-files=normal)
	[ -z "$dirty" ] || die "the tree has uncommitted changes or untracked files; commit or stash them first:
$dirty"
	grep -q "^## \[${VERSION//./\\.}\]" CHANGELOG.md ||
		die "CHANGELOG.md has no \"## [$VERSION] - YYYY-MM-DD\" section: move Unreleased's lines under it first"
fi
[ ! -e "$out" ] || die "$out already exists: a release is never overwritten (remove it to build again)"

# 3. The binaries, per architecture, with the flags kvipam-image uses (so
# those the image carries too are byte for byte the same): static,
# -trimpath, no symbol table and no build ID, plus the version and commit.
pkgs=()
for c in $cmds; do
	[ -d "cmd/$c" ] || die "no command cmd/$c"
	pkgs+=("./cmd/$c")
done
mkdir -p "$out"
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
for arch in $archs; do
	echo "release: building ${cmds// /, } for linux/$arch" >&2
	CGO_ENABLED=0 GOOS=linux GOARCH=$arch \
		"$GO" build -trimpath -ldflags "-s -w -buildid= $LDFLAGS" -o "$stage/$arch/" "${pkgs[@]}"
	for c in $cmds; do
		mv "$stage/$arch/$c" "$out/$c-linux-$arch"
	done
done

# 4. The image archive and its manifests, through make image.
if [ "$image" = 1 ]; then
	echo "release: building the image for ${archs// /, }" >&2
	"$MAKE" --no-print-directory image VERSION="$VERSION" COMMIT="$COMMIT" BIN="$out" IMAGE_ARCHS="${archs// /,}"
fi

# 5. The checksums, of every file but themselves.
(cd "$out" && find . -maxdepth 1 -type f ! -name SHA256SUMS -printf '%f\n' | LC_ALL=C sort | xargs -d '\n' sha256sum -- >SHA256SUMS)
(cd "$out" && sha256sum --quiet -c SHA256SUMS)
echo "release: $VERSION ($COMMIT) in $out:" >&2
cat "$out/SHA256SUMS" >&2
