# kvipam — see README.md. Every target is one readable line or two.
GO        ?= go
BIN       := bin
PKGS      := ./...
# The whole suite; root-only tests skip themselves when not root.
TEST_FLAGS ?= -count=1 -timeout 15m

.PHONY: all build test k8s-bin k8s-e2e race bench bench-quick bench-run fuzz demo lint check-layout generate check-generate clean image chaos model-sim release

all: build

# The build's version and commit, which every binary's --version reports
# (package internal/foundation/buildinfo).
VERSION ?= $(shell git describe --always --dirty 2>/dev/null || echo dev)
COMMIT  ?= $(shell git rev-parse HEAD 2>/dev/null)
LDFLAGS := -X github.com/kvipam/kvipam/internal/foundation/buildinfo.version=$(VERSION) -X github.com/kvipam/kvipam/internal/foundation/buildinfo.commit=$(COMMIT)

build:
	$(GO) build -ldflags '$(LDFLAGS)' -o $(BIN)/ ./cmd/...

test: build
	$(GO) vet $(PKGS)
	$(GO) test $(TEST_FLAGS) -skip '^TestMixedVersionChaos$$' $(PKGS)
	KVIPAM_E2E_DATAPATH=bpf $(GO) test $(TEST_FLAGS) -skip '^TestMixedVersionChaos$$' ./e2e/
	CHAOS_DURATION=3m $(GO) test $(TEST_FLAGS) -v -run '^TestChaosRun$$' ./e2e/
	$(GO) test $(TEST_FLAGS) -v -run '^TestMixedVersionChaos$$' ./e2e/
	$(MAKE) race
	if [ "$$(id -u)" = 0 ]; then $(MAKE) k8s-e2e K8S_BENCHTIME=1x; else echo 'k8s-e2e skipped: needs root'; fi

# A real Kubernetes (e2e/k8s, a module of its own): v1.34's five binaries
# built from the module proxy into a gitignored directory (Go's build cache
# makes a rebuild seconds), then the cluster tests and the pod burst.
K8S_BIN := $(CURDIR)/.cache/k8s/bin
K8S_BURST ?= 20
K8S_BENCHTIME ?= 3x
# make bench's bursts: 30 and 100 pods, each network measured in each of
# K8S_ROUNDS interleaved rounds, each burst after K8S_SINGLES pods one at
# a time. One round's last pod moves by seconds: three rounds at least.
K8S_BENCH_BURSTS ?= 30,100
K8S_ROUNDS ?= 3
K8S_SINGLES ?= 6
# The churn on one node (BenchmarkK8sChurn): K8S_CHURN_RATE pods created
# and as many deleted a second for K8S_CHURN_SECONDS, kvipam and bridge in
# turn; then the ceiling, each rate of K8S_CHURN_SWEEP for
# K8S_CHURN_STEP seconds, until ADD p99 passes 1 s.
K8S_CHURN_RATE ?= 10
K8S_CHURN_SECONDS ?= 600
K8S_CHURN_SWEEP ?= 2,5,10,20,40
K8S_CHURN_STEP ?= 60
k8s-bin:
	cd e2e/k8s && $(GO) build -ldflags='-s -w' -o $(K8S_BIN)/ $(addprefix k8s.io/kubernetes/cmd/,kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl)
# Every test of the module: the cluster's (TestK8s*) and the burst
# harness's own (containerd's log, process events, CPU accounting).
k8s-e2e: k8s-bin
	cd e2e/k8s && KVIPAM_K8S_BIN=$(K8S_BIN) KVIPAM_K8S_BURST=$(K8S_BURST) $(GO) test -count=1 -timeout 45m -v -run '^Test' -bench '^BenchmarkK8sBurst$$' -benchtime $(K8S_BENCHTIME) .

# The packages with concurrency, under the race detector (part of test).
race:
	$(GO) test -count=1 -race ./allocator/... ./kvstore/... ./internal/... ./agent/... ./cni/... ./e2e/cluster/...

# Benchmarks: each command's output goes to $(BENCH_OUT)/<name>.txt and
# their raw samples to $(BENCH_OUT)/samples (KVIPAM_BENCH_SAMPLES), then
# kvipam-benchreport writes docs/BENCHMARKS.md, docs/benchmarks.json (every
# figure beside its baseline from the same run) and the plots, docs/plots.
# bench-quick is the same at smaller sizes, in a few minutes.
BENCH_OUT ?= bench-out
STORM_NODES ?= 5000
STORM10K_NODES ?= 10000
FILL_NODES ?= 5000
FILL_ADDRS ?= 30
LAT_N ?= 200
# Live migration's moves per routing (host-gw, vxlan, bgp), each moving
# a dual-stack VM between two nodes (e2e BenchmarkMigration).
MIGRATION_MOVES ?= 20
# BenchmarkHostPortAdd's pods per configuration (host ports by the datapath, by portmap, none).
HOSTPORT_N ?= 100
STEADY_SECONDS ?= 10
SWEEP_SECONDS ?= 3
# bench runs the micro-benchmarks also when bench-run failed, and fails
# at the end unless bench-run completed. (Each line on its own: make -n
# runs a line that holds $(MAKE), so no other command may share it.)
bench:
	-$(MAKE) bench-run
	$(GO) test -run '^$$' -bench . -skip 'TightPool|ClaimStorm|ClaimCost|AgentRestart|^BenchmarkFill$$|^BenchmarkSteady$$' -benchtime 2000x ./allocator/... ./agent/...
	$(GO) test -run '^$$' -bench . -benchtime 200x ./bpf/...
	@test -f $(BENCH_OUT)/complete || { echo 'bench: bench-run failed; see its output above'; exit 1; }

bench-quick:
	$(MAKE) bench-run STORM_NODES=1000 STORM10K_NODES=2000 FILL_NODES=1000 FILL_ADDRS=10 LAT_N=50 HOSTPORT_N=10 MIGRATION_MOVES=5 STEADY_SECONDS=3 SWEEP_SECONDS=2 K8S_ROUNDS=1 K8S_CHURN_SECONDS=60 K8S_CHURN_SWEEP=2,5,10 K8S_CHURN_STEP=30

bench-run: build
	if [ "$$(id -u)" = 0 ]; then $(MAKE) k8s-bin; fi
	rm -rf $(BENCH_OUT) && mkdir -p $(BENCH_OUT)
	@run() { name=$$1; shift; echo "$$*" >> $(BENCH_OUT)/commands.txt; echo "$$*"; \
		if env KVIPAM_BENCH_SAMPLES=$(abspath $(BENCH_OUT)/samples) "$$@" > $(BENCH_OUT)/$$name.txt 2>&1; then grep '^Benchmark' $(BENCH_OUT)/$$name.txt; \
		else tail -n 30 $(BENCH_OUT)/$$name.txt; echo "bench: $$name FAILED, its figures are left out (all its output: $(BENCH_OUT)/$$name.txt)"; echo $$name >> $(BENCH_OUT)/failed.txt; fi; }; \
	run choose $(GO) test -run '^$$' -bench ChooseBlock -benchtime 2000x ./allocator/nodealloc/planner/ ; \
	run storm KVIPAM_STORM_NODES=$(STORM_NODES) $(GO) test -run '^$$' -bench ClaimStorm -benchtime 1x -timeout 30m ./allocator/nodealloc/ ; \
	run claimcost KVIPAM_STORM_NODES=$(STORM_NODES) $(GO) test -run '^$$' -bench ClaimCost -benchtime 1x -timeout 30m ./allocator/nodealloc/ ; \
	run storm10k KVIPAM_STORM_NODES=$(STORM10K_NODES) KVIPAM_STORM_REQUEST_TIMEOUT=5s $(GO) test -run '^$$' -bench ClaimStorm -benchtime 1x -timeout 30m ./allocator/nodealloc/ ; \
	run steady KVIPAM_FILL_NODES=$(FILL_NODES) KVIPAM_FILL_ADDRS=$(FILL_ADDRS) KVIPAM_STEADY_SECONDS=$(STEADY_SECONDS) KVIPAM_SWEEP_SECONDS=$(SWEEP_SECONDS) $(GO) test -run '^$$' -bench '^BenchmarkSteady$$' -benchtime 1x -timeout 30m ./allocator/nodealloc/ ; \
	run tight $(GO) test -run '^$$' -bench TightPool -benchtime 1x ./allocator/nodealloc/ ; \
	run restart $(GO) test -run '^$$' -bench AgentRestart -benchtime 5x ./agent/ ; \
	run attach $(GO) test -run '^$$' -bench AttachDetach -benchtime 50x ./bpf/ ; \
	run datapath $(GO) test -run '^$$' -bench 'AddDatapath$$' -benchtime 100x ./e2e/ ; \
	run datapath-loaded $(GO) test -run '^$$' -bench AddDatapathLoaded -benchtime $(LAT_N)x ./e2e/ ; \
	run adddel KVIPAM_E2E_DATAPATH=bpf $(GO) test -run '^$$' -bench AddDel -benchtime $(LAT_N)x ./e2e/ ; \
	run burst KVIPAM_E2E_DATAPATH=bpf $(GO) test -run '^$$' -bench Burst100 -benchtime 3x ./e2e/ ; \
	run burst-routes $(GO) test -run '^$$' -bench Burst100 -benchtime 3x ./e2e/ ; \
	run burst-locks KVIPAM_LOCK_TRACE=1 KVIPAM_E2E_DATAPATH=bpf $(GO) test -run '^$$' -bench Burst100 -benchtime 2x ./e2e/ ; \
	run hostport $(GO) test -run '^$$' -bench HostPortAdd -benchtime $(HOSTPORT_N)x ./e2e/ ; \
	run migration KVIPAM_MIGRATION_MOVES=$(MIGRATION_MOVES) $(GO) test -run '^$$' -bench '^BenchmarkMigration$$' -benchtime 1x -timeout 30m ./e2e/ ; \
	if [ "$$(id -u)" = 0 ]; then \
	run k8s sh -c "cd e2e/k8s && KVIPAM_K8S_BIN=$(K8S_BIN) KVIPAM_K8S_BURST=$(K8S_BENCH_BURSTS) KVIPAM_K8S_ROUNDS=$(K8S_ROUNDS) KVIPAM_K8S_SINGLES=$(K8S_SINGLES) KVIPAM_K8S_CHURN_RATE=$(K8S_CHURN_RATE) KVIPAM_K8S_CHURN_SECONDS=$(K8S_CHURN_SECONDS) KVIPAM_K8S_CHURN_SWEEP=$(K8S_CHURN_SWEEP) KVIPAM_K8S_CHURN_STEP_SECONDS=$(K8S_CHURN_STEP) $(GO) test -count=1 -run '^$$' -v -bench '^BenchmarkK8s(Burst|Churn)$$' -benchtime 1x -timeout 180m ."; \
	else echo 'k8s bench skipped: needs root'; fi
	$(GO) run ./cmd/kvipam-benchreport -in $(BENCH_OUT) -json docs/benchmarks.json -md docs/BENCHMARKS.md -svg docs/plots
	@echo "wrote docs/BENCHMARKS.md, docs/benchmarks.json and docs/plots"
	@if [ -s $(BENCH_OUT)/failed.txt ]; then echo "bench: failed, their figures missing from the report:" $$(cat $(BENCH_OUT)/failed.txt); exit 1; fi
	@touch $(BENCH_OUT)/complete

# The chaos workload (root): etcd members and agents as processes, faults
# at random, a history checker. CHAOS_DURATION (3m), CHAOS_SEED, CHAOS_NODES,
# CHAOS_ROUTING (bgp: the agents announce to FRR, and what it heard is checked),
# CHAOS_MIXED=v0.1.0 (mixed versions: each node on that release, built from
# git, or on HEAD, upgraded and rolled back during the run as an operator
# does; its short form is TestMixedVersionChaos in make test).
chaos: build
	CHAOS_DURATION=$${CHAOS_DURATION:-3m} $(GO) test -count=1 -v -run '^TestChaosRun$$' -timeout 90m ./e2e/

# The node allocator's model test on the in-memory store and its fake
# clock (TestModelSimulated): nothing sleeps, and a seed replays bit for
# bit. It prints the seed, the time, the fault and operation tables, and
# on a failure the one-line command that replays it. SEED=0 picks one.
STEPS ?= 1000000
SEED ?= 0
model-sim:
	$(GO) test -count=1 -v -timeout 60m -run '^TestModelSimulated$$' ./allocator/nodealloc -model.steps=$(STEPS) -model.seed=$(SEED)

# The fuzz targets, briefly (go test takes one -fuzz at a time): the CNI
# parsers, and the etcd records' round trip of members a version does not
# know. Bounded by a count of inputs, not a duration: with a duration Go's
# fuzzing coordinator ends with "context deadline exceeded" when a loaded
# machine has not finished the seed corpus's baseline by then, a failure
# that says nothing about the code. FUZZTIME=30s still works for a timed run.
FUZZTIME ?= 200000x
FUZZPARALLEL ?= 2
fuzz:
	$(GO) test -run '^$$' -fuzz '^FuzzParseConfig$$' -fuzztime $(FUZZTIME) -parallel $(FUZZPARALLEL) ./cni/
	$(GO) test -run '^$$' -fuzz '^FuzzParseArgs$$' -fuzztime $(FUZZTIME) -parallel $(FUZZPARALLEL) ./cni/
	$(GO) test -run '^$$' -fuzz '^FuzzUnknownFields$$' -fuzztime $(FUZZTIME) -parallel $(FUZZPARALLEL) ./allocator/etcdstore/
	$(GO) test -run '^$$' -fuzz '^FuzzReadResponse$$' -fuzztime $(FUZZTIME) -parallel $(FUZZPARALLEL) ./agent/client/

# go build -v names each package as it compiles: on a cold machine the
# first build takes minutes, and says so rather than stay silent.
demo:
	@echo 'make demo: building kvipam-demo (a cold machine downloads and compiles the modules first: minutes)' >&2
	$(GO) build -v -ldflags '$(LDFLAGS)' -o $(BIN)/kvipam-demo ./cmd/kvipam-demo
	$(BIN)/kvipam-demo

# The container image as an OCI archive (no daemon, no registry, no shell
# inside): one index with linux/amd64 and linux/arm64 images, tagged with
# the build's VERSION; the same commit gives the same digest. It also
# renders deploy/kubernetes's manifests into $(BIN) naming that image.
IMAGE_REPO ?= ghcr.io/kvipam/kvipam
IMAGE ?= $(IMAGE_REPO):$(VERSION)
IMAGE_ARCHS ?= amd64,arm64
MANIFESTS := deploy/kubernetes/kvipam-agent.yaml,deploy/kubernetes/uninstall/kvipam-uninstall.yaml
image:
	$(GO) run ./cmd/kvipam-image --out $(BIN)/kvipam-image.tar --ref $(IMAGE) --arch $(IMAGE_ARCHS) --ldflags '$(LDFLAGS)' --manifests $(MANIFESTS) --manifest-dir $(BIN)

# A release (docs/releasing.md): make release VERSION=v1.2.3 builds every
# released command for linux/amd64 and linux/arm64 and the image archive,
# stamped with that VERSION, into bin/release/$(VERSION)/ with SHA256SUMS.
# It refuses a VERSION that is not semver, a dirty tree, and a VERSION with
# no CHANGELOG.md section. The steps are in scripts/release.sh.
release:
	VERSION='$(VERSION)' COMMIT='$(COMMIT)' LDFLAGS='$(LDFLAGS)' GO='$(GO)' MAKE='$(MAKE)' ./scripts/release.sh

lint: check-layout
	@test -z "$$(gofmt -l $$(git ls-files '*.go'))" || { gofmt -l $$(git ls-files '*.go'); echo 'gofmt needed'; exit 1; }
	$(GO) vet $(PKGS)
	cd e2e/k8s && $(GO) vet ./...

# Import directions, one home for the etcd keys, files under a line cap but
# the exceptions in scripts/layout-exceptions.txt, no binaries in git.
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
