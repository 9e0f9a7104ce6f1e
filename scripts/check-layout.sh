#!/usr/bin/env bash
# Checks the layout rules of docs/design.md ("How the code is laid out"):
# import directions, one home for the etcd key schema, small files, and no
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
# The pure allocator imports the standard library and internal foundations
# only; the records import neither etcd nor the node allocator.
pure=$(go list -f '{{join .Imports "\n"}}' ./allocator | grep '\.' | grep -v '^github.com/kvipam/kvipam/internal/' || true)
[ -z "$pure" ] || bad "allocator (pure) imports $(echo $pure)"
recs=$(go list -f '{{join .Imports "\n"}}' ./allocator/records | grep -E 'go.etcd.io|/allocator/nodealloc|/allocator/etcdstore' || true)
[ -z "$recs" ] || bad "allocator/records imports $(echo $recs)"
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
