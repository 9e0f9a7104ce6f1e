# kvipam — see README.md. Every target is one readable line or two.
GO        ?= go
BIN       := bin
PKGS      := ./...
# The whole suite; root-only tests skip themselves when not root.
TEST_FLAGS ?= -count=1 -timeout 15m

.PHONY: all build test race bench fuzz demo lint check-layout generate check-generate clean image chaos

all: build

build:
	$(GO) build -o $(BIN)/ ./cmd/...

test: build
	$(GO) vet $(PKGS)
	$(GO) test $(TEST_FLAGS) $(PKGS)
	KVIPAM_E2E_DATAPATH=bpf $(GO) test $(TEST_FLAGS) ./e2e/
	CHAOS_DURATION=3m $(GO) test $(TEST_FLAGS) -v -run '^TestChaosRun$$' ./e2e/
	$(MAKE) race

# The packages with concurrency, under the race detector (part of test).
race:
	$(GO) test -count=1 -race ./allocator/... ./kvstore/... ./internal/... ./agent/... ./cni/... ./e2e/cluster/...

bench:
	$(GO) test -run '^$$' -bench . -skip 'TightPool|ClaimStorm|AgentRestart|^BenchmarkFill$$' -benchtime 2000x ./allocator/... ./agent/...
	$(GO) test -run '^$$' -bench AgentRestart -benchtime 5x ./agent/
	$(GO) test -run '^$$' -bench TightPool -benchtime 1x ./allocator/
	KVIPAM_STORM_NODES=5000 $(GO) test -run '^$$' -bench ClaimStorm -benchtime 1x -timeout 30m ./allocator/
	$(GO) test -run '^$$' -bench '^BenchmarkFill$$' -benchtime 1x -timeout 30m ./allocator/
	$(GO) test -run '^$$' -bench . -benchtime 200x ./bpf/...
	$(GO) test -run '^$$' -bench AddDel -benchtime 200x ./e2e/
	$(GO) test -run '^$$' -bench AddDatapath -benchtime 100x ./e2e/
	$(GO) test -run '^$$' -bench Burst100 -benchtime 3x ./e2e/
	KVIPAM_E2E_DATAPATH=bpf $(GO) test -run '^$$' -bench Burst100 -benchtime 3x ./e2e/

# The chaos workload (root): etcd members and agents as processes, faults
# at random, a history checker. CHAOS_DURATION (3m), CHAOS_SEED, CHAOS_NODES.
chaos: build
	CHAOS_DURATION=$${CHAOS_DURATION:-3m} $(GO) test -count=1 -v -run '^TestChaosRun$$' -timeout 90m ./e2e/

# The CNI parsers' fuzz targets, briefly (go test takes one -fuzz at a time).
FUZZTIME ?= 15s
fuzz:
	$(GO) test -run '^$$' -fuzz '^FuzzParseConfig$$' -fuzztime $(FUZZTIME) ./cni/
	$(GO) test -run '^$$' -fuzz '^FuzzParseArgs$$' -fuzztime $(FUZZTIME) ./cni/

demo:
	$(GO) run ./cmd/kvipam-demo

# The container image as an OCI archive (no daemon, no registry, no shell
# inside); the same commit gives the same digest. IMAGE is the reference it
# records, which deploy/kubernetes names.
IMAGE ?= ghcr.io/kvipam/kvipam:dev
image:
	$(GO) run ./cmd/kvipam-image --out $(BIN)/kvipam-image.tar --ref $(IMAGE)

lint: check-layout
	@test -z "$$(gofmt -l $$(git ls-files '*.go'))" || { gofmt -l $$(git ls-files '*.go'); echo 'gofmt needed'; exit 1; }
	$(GO) vet $(PKGS)

# Import directions, one home for the etcd keys, small files, no binaries in git.
check-layout:
	./scripts/check-layout.sh

# Installs clang/llvm/libbpf-dev from Debian when missing, then runs bpf2go.
generate:
	./bpf/generate.sh

# CI: the committed eBPF objects must match the C source.
check-generate: generate
	git diff --exit-code -- bpf/ || { echo 'bpf/ generated files are stale: run make generate and commit'; exit 1; }

clean:
	rm -rf $(BIN)
