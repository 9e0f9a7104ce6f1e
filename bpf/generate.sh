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
	# Wait up to 10 minutes for another apt's locks: install waits for the
	# dpkg lock itself (DPkg::Lock::Timeout); update's lock on the package
	# lists ignores that option (apt 2.6), so update is retried while the
	# lock is what it fails on.
	lock="DPkg::Lock::Timeout=600"
	tries=0
	until err=$(apt-get -o "$lock" update 2>&1); do
		tries=$((tries + 1))
		case $err in
		*"Could not get lock"*) [ "$tries" -lt 60 ] || { echo "$err" >&2; exit 1; } ;;
		*) echo "$err" >&2; exit 1 ;;
		esac
		echo "apt-get update: waiting for another apt's lock" >&2
		sleep 10
	done
	# shellcheck disable=SC2086 # word splitting is intended
	DEBIAN_FRONTEND=noninteractive apt-get -o "$lock" install -y --no-install-recommends $missing
fi

go generate ./...
