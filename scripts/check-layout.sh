#!/usr/bin/env bash
# Checks the layout rules of docs/design.md ("How the code is laid out"):
# import directions, internal/ by role, one home for the etcd key schema, small files, and no
# build outputs in git. Prints every violation; exits non-zero if any.
set -uo pipefail
cd "$(dirname "$0")/.."
fail=0
bad() { echo "check-layout: $*"; fail=1; }

# The agent serves the plugins' contracts; it never imports the plugins.
deps=$(go list -deps ./agent/... 2>&1) || { echo "$deps"; exit 1; }
if grep -q '^github.com/kvipam/kvipam/cni' <<<"$deps"; then
	bad "agent depends on cni: $(grep '^github.com/kvipam/kvipam/cni' <<<"$deps" | tr '\n' ' ')"
fi
# Transport details are mapped below the agent (kvstore/etcdstore).
grpc=$(go list -f '{{.ImportPath}} {{join .Imports " "}}' ./agent/... | awk '/google.golang.org\/grpc/ {print $1}')
[ -z "$grpc" ] || bad "agent code imports grpc: $(echo $grpc)"
# The pure allocator has no etcd import.
if go list -f '{{join .Imports "\n"}}' ./allocator | grep -q 'go.etcd.io'; then
	bad "allocator imports etcd"
fi
# internal/ by role. Foundations are the bottom layer: they import no
# other kvipam package. Test support (etcd, netns, agents, cut proxies for
# tests) is imported by tests only, and tools (bench reports, lock traces,
# image building) by commands and tests only: no production code
# depends on either.
found=$(go list -f '{{.ImportPath}} {{join .Imports " "}}' ./internal/foundation/... |
	awk '{for (i = 2; i <= NF; i++) if ($i ~ /^github.com\/kvipam\/kvipam\//) print $1 " imports " $i}')
[ -z "$found" ] || bad "a foundation imports kvipam: $(echo $found)"
mod=github.com/kvipam/kvipam
while read -r pkg imports; do
	for imp in $imports; do
		case "$imp" in
		$mod/internal/testsupport/*)
			case "$pkg" in $mod/internal/testsupport/*) ;; *) bad "$pkg imports test support $imp outside its tests" ;; esac ;;
		$mod/internal/tools/*)
			case "$pkg" in $mod/internal/tools/* | $mod/cmd/*) ;; *) bad "$pkg imports tool $imp outside its tests" ;; esac ;;
		esac
	done
done < <(go list -f '{{.ImportPath}} {{join .Imports " "}}' ./...)
# The etcd key layout is spelled only in allocator/etcdstore.
keys=$(grep -rln '"/kvipam/v1' --include=*.go . | grep -v '^./allocator/etcdstore/' || true)
[ -z "$keys" ] || bad "the key prefix is spelled outside allocator/etcdstore: $(echo $keys)"
# One concept per file: no hand-written Go file over 450 lines.
while read -r f; do
	case "$f" in *_test.go) continue ;; esac
	head -c 300 "$f" | grep -q 'Code generated .* DO NOT EDIT' && continue
	n=$(wc -l <"$f")
	[ "$n" -le 450 ] || bad "$f has $n lines (over 450)"
done < <(git ls-files '*.go')
# No build outputs in git.
while read -r f; do
	[ -f "$f" ] || continue
	size=$(stat -c %s "$f")
	if [ "$size" -gt 1048576 ] && ! grep -Iq . "$f"; then
		bad "$f is a binary of $size bytes"
	fi
done < <(git ls-files)
exit $fail
