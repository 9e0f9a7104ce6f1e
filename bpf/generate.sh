#!/bin/sh
# generate.sh regenerates kvipam_bpfel.go and kvipam_bpfel.o from kvipam.c.
# It installs clang, llvm and libbpf-dev with apt-get when they are missing
# (Debian/Ubuntu, as root), then runs go generate in this directory.
set -eu

cd "$(dirname "$0")"

missing=""
command -v clang >/dev/null 2>&1 || missing="$missing clang"
command -v llvm-strip >/dev/null 2>&1 || missing="$missing llvm"
[ -f /usr/include/bpf/bpf_helpers.h ] || missing="$missing libbpf-dev"
if [ -n "$missing" ]; then
	echo "installing:$missing" >&2
	apt-get update
	# shellcheck disable=SC2086 # word splitting is intended
	DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $missing
fi

go generate ./...
