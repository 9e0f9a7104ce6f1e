#!/usr/bin/env bash
# Checks the layout rules of docs/design.md ("How the code is laid out"):
# import directions, internal/ by role, one home for the etcd key schema,
# its transactions and its key parsing, files by concept under a line cap
# with written exceptions (scripts/layout-exceptions.txt), and no build
# outputs in git. Prints every violation; exits non-zero if any.
set -uo pipefail
cd "$(dirname "$0")/.."
fail=0
bad() { echo "check-layout: $*"; fail=1; }

# The agent serves the plugins' contracts; it never imports the plugins.
deps=$(go list -deps ./agent/... 2>&1) || { echo "$deps"; exit 1; }
if grep -q '^github.com/kvipam/kvipam/cni' <<<"$deps"; then
	bad "agent depends on cni: $(grep '^github.com/kvipam/kvipam/cni' <<<"$deps" | tr '\n' ' ')"
fi
# Routing between nodes (routing/, routing/bgp) is composed by the agent and
# never imports it: nothing under agent/ but the API contract, agent/api (the
# wire types routing/bgp's Status is). The agent package itself would be an
# import cycle; this keeps routing off the agent's other packages too.
rdeps=$(go list -deps ./routing/... 2>&1) || { echo "$rdeps"; exit 1; }
back=$(grep -E '^github.com/kvipam/kvipam/(agent(/|$)|cni(/|$))' <<<"$rdeps" | grep -vx 'github.com/kvipam/kvipam/agent/api' || true)
[ -z "$back" ] || bad "routing depends on $(echo $back)"
# Transport details are mapped below the agent (kvstore/etcdstore).
grpc=$(go list -f '{{.ImportPath}} {{join .Imports " "}}' ./agent/... | awk '/google.golang.org\/grpc/ {print $1}')
[ -z "$grpc" ] || bad "agent code imports grpc: $(echo $grpc)"
# The pure allocator imports the standard library and internal foundations
# only; the records import neither etcd nor the node allocator.
pure=$(go list -f '{{join .Imports "\n"}}' ./allocator | grep '\.' | grep -v '^github.com/kvipam/kvipam/internal/' || true)
[ -z "$pure" ] || bad "allocator (pure) imports $(echo $pure)"
recs=$(go list -f '{{join .Imports "\n"}}' ./allocator/records | grep -E 'go.etcd.io|/allocator/nodealloc|/allocator/etcdstore' || true)
[ -z "$recs" ] || bad "allocator/records imports $(echo $recs)"
# The node allocator's planner decides without I/O: no context, no store
# (nodealloc), no logger, no etcd.
plan=$(go list -f '{{join .Imports "\n"}}' ./allocator/nodealloc/planner | grep -E '^context$|go-hclog|go.etcd.io|/allocator/nodealloc$|/allocator/etcdstore|/kvstore' || true)
[ -z "$plan" ] || bad "allocator/nodealloc/planner imports $(echo $plan)"
# internal/ by role. Foundations are the bottom layer: they import no
# kvipam package but one another. Test support (simulated agents, netns,
# cut proxies, leak checks, shared buffers) is imported by tests only, and tools (bench reports, lock traces,
# image building) by commands and tests only: no production code
# depends on either.
found=$(go list -f '{{.ImportPath}} {{join .Imports " "}}' ./internal/foundation/... |
	awk '{for (i = 2; i <= NF; i++) if ($i ~ /^github.com\/kvipam\/kvipam\// && $i !~ /^github.com\/kvipam\/kvipam\/internal\/foundation\//) print $1 " imports " $i}')
[ -z "$found" ] || bad "a foundation imports kvipam beyond the foundations: $(echo $found)"
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
# One door to etcd: transactions and key parsing only in allocator/etcdstore
# (kvstore, the generic layer under it, may build transactions too). Tests
# may read and write etcd raw to check state or fake a restore; production
# code asks etcdstore.
door=()
while read -r f; do
	case "$f" in *_test.go | allocator/etcdstore/* | kvstore/*) continue ;; esac
	[ -f "$f" ] && door+=("$f")
done < <(git ls-files --cached --others --exclude-standard '*.go')
# A raw transaction: a Txn, its operations and compares, or kvstore's
# compare-and-swap helpers.
txn='\.Txn\(|clientv3\.(Op|Cmp|Txn)\b|clientv3\.Op(Get|Put|Delete|Txn)\(|clientv3\.Compare\('
txn+='|clientv3\.(ModRevision|CreateRevision|Version|Value|LeaseValue)\('
txn+='|kvstore\.(Absent|Exists|Unchanged|PrefixEmpty|DeleteAt|CreateJSON|SwapJSON)\('
while read -r hit; do
	bad "raw etcd transaction outside allocator/etcdstore (use an etcdstore method): $hit"
done < <(grep -nE "$txn" "${door[@]}")
# Key parsing: reading a block name back, cutting or splitting a key
# (string(kv.Key), ev.Kv.Key), or cutting at one of etcdstore's prefixes
# (use etcdstore.ParseKey).
split='(strings|bytes)\.(Cut|CutPrefix|CutSuffix|TrimPrefix|TrimSuffix|Split|SplitN|SplitAfter|Fields|FieldsFunc|Index|LastIndex|HasPrefix|HasSuffix)\('
while read -r hit; do
	bad "key parsed outside allocator/etcdstore (use etcdstore.ParseKey): $hit"
done < <(grep -nE 'allocator\.ParseBlockName\(|(strings|bytes)\.[A-Za-z]+\(string\([A-Za-z_.]*\.Key\)' "${door[@]}"
	grep -nE "$split" "${door[@]}" | grep -E 'etcdstore\.[A-Za-z]*Prefix\b')
# One concept per file: no hand-written Go file over 450 lines, but the
# concepts listed with their reasons in scripts/layout-exceptions.txt; an
# exception no longer over the cap is stale and fails too.
cap=450
exceptions=scripts/layout-exceptions.txt
declare -A excepted=()
if [ -f "$exceptions" ]; then
	while read -r path reason; do
		case "$path" in '' | '#'*) continue ;; esac
		[ -n "$reason" ] || bad "$exceptions: $path gives no reason"
		[ -z "${excepted[$path]:-}" ] || bad "$exceptions: $path is listed twice"
		excepted[$path]=1
	done <"$exceptions"
else
	bad "$exceptions is missing (it lists the files allowed over the cap; it may list none)"
fi
capped() { # a hand-written Go file that is not a test
	case "$1" in *_test.go) return 1 ;; *.go) ;; *) return 1 ;; esac
	! head -c 300 "$1" | grep -q 'Code generated .* DO NOT EDIT'
}
while read -r f; do
	capped "$f" || continue
	n=$(wc -l <"$f")
	[ "$n" -le $cap ] || [ -n "${excepted[$f]:-}" ] ||
		bad "$f has $n lines (over $cap): split it by concept, or list it with its reason in $exceptions"
done < <(git ls-files '*.go')
for f in "${!excepted[@]}"; do
	if ! git ls-files --error-unmatch -- "$f" >/dev/null 2>&1; then
		bad "$exceptions: $f is not in git: remove the stale exception"
	elif ! capped "$f"; then
		bad "$exceptions: $f is a test, generated or not Go (the cap does not apply): remove it"
	elif n=$(wc -l <"$f") && [ "$n" -le $cap ]; then
		bad "$exceptions: $f has $n lines, no longer over $cap: remove the stale exception"
	fi
done
# The CNI plugins start once a pod: they link neither net/http (and
# crypto/tls with it) nor hclog and its terminal packages, whose inits
# and pages were a third of their start-up (docs/cni.md, "Starting the
# plugin").
pdeps=$(go list -deps ./cmd/kvipam ./cmd/kvipam-ipam 2>&1) || { echo "$pdeps"; exit 1; }
heavy=$(grep -E '^(net/http|crypto/tls|github.com/hashicorp/go-hclog|github.com/fatih/color|github.com/mattn/go-isatty|github.com/mattn/go-colorable)$' <<<"$pdeps" || true)
[ -z "$heavy" ] || bad "the CNI plugins (cmd/kvipam, cmd/kvipam-ipam) link $(echo $heavy)"
# No build outputs in git.
while read -r f; do
	[ -f "$f" ] || continue
	size=$(stat -c %s "$f")
	if [ "$size" -gt 1048576 ] && ! grep -Iq . "$f"; then
		bad "$f is a binary of $size bytes"
	fi
done < <(git ls-files)
exit $fail
