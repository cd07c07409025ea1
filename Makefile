# The README's two commands live here so that CI (.ci/run) and users run the same thing.
.PHONY: demo simulate test lint unit chart e2e build musl bench bench-quick fuzz-smoke release release-check

# A local cluster on real nodes (root): etcd, kube-apiserver, kube-controller-manager and
# kube-scheduler built from their Go modules, three nodes with simulated GPUs of three models, each
# a kubelet with its own containerd (e2e/node-tools.sh installs Debian's containerd, runc and CNI
# plugins once), Tessera installed with `helm install`; then the pods of examples/demo/pods.yaml in
# file order, a table of where each went and why the others wait, and what each placed pod sees
# inside. Ctrl-C stops and removes everything. It runs the tessera-demo that `build` made (a
# `cargo run -p tessera-e2e` would compile the workspace a second time, with that package's
# features). On a fresh machine the first run also builds the control plane (~18 minutes on two
# cores), helm (~5 minutes) and the node images, all cached; later runs take about a minute.
demo: build
	./e2e/node-tools.sh >/dev/null
	"$${CARGO_TARGET_DIR:-target}/debug/tessera-demo" -f examples/demo/pods.yaml

# The same fit/score code offline: places examples/simulate/cluster.yaml's pending pods.
simulate:
	cargo run --locked -p tessera-scheduler -- simulate -f examples/simulate/cluster.yaml

# The whole test suite, as CI runs it.
test: lint unit chart e2e musl bench-quick fuzz-smoke

# Formatting, clippy (the daemons' clippy.toml bans std::time::Instant: tokio's clock, so paused
# test clocks reach every deadline), the pure crates' dependency trees (no I/O crate in
# tessera-scheduler-core or hami-contract), and cargo-deny's licence, ban and source checks
# (installs a pinned cargo-deny once, about 8 minutes; advisories need GitHub, unreachable here).
# Module circles and the contract citations are checked by tests in `make unit`
# (hami-contract/tests/module_cycles.rs, contract_refs.rs). The GitHub workflows are linted with
# actionlint and shellcheck, and the release scripts checked (scripts/lint-workflows.sh).
lint:
	cargo fmt --all -- --check
	cargo clippy --locked --workspace --all-targets -- -D warnings
	./scripts/check-core-deps.sh
	./scripts/deny.sh
	./scripts/lint-workflows.sh

unit:
	cargo test --locked --workspace --exclude tessera-e2e

# Every daemon binary, the shim and the fake driver libraries the e2e cluster runs.
build:
	cargo build --locked --workspace

# Scenarios on the real control plane (e2e/control-plane.sh builds it once, with a newer
# kube-scheduler for the preemption scenario that needs one, kubelet and
# kube-controller-manager included), on harness nodes and on real nodes (kubelet + containerd,
# which e2e/node-tools.sh installs from Debian's packages once; root; containerd v2 for the DRA
# nodes, e2e/containerd-v2.sh), and the previous release an upgrade starts from
# (e2e/previous-release.sh, built from this repository's history once). The Go builds run here, before the tests: a test builds what is
# missing inside its network namespace, where the module proxy cannot be reached, and the demo
# test gives the cluster five minutes, not the 20 a cold build takes. One cluster at a time: two
# cores cannot host several apiservers.
e2e: build
	./e2e/node-tools.sh >/dev/null
	./e2e/control-plane.sh >/dev/null
	./e2e/containerd-v2.sh >/dev/null
	./e2e/previous-release.sh >/dev/null
	./e2e/tools.sh >/dev/null
	cargo test --locked -p tessera-e2e -- --test-threads=1

# Helm lint/template/kubeconform on the chart; builds pinned helm and kubeconform with Go into
# ~/.cache/tessera on first use (about 5 minutes once). Runs after `unit` so that the daemons'
# binaries exist and the chart's flags are checked against them. Then the kubectl plugin's krew
# manifest, installed by krew from the archive `make release` makes (scripts/krew-check.sh).
chart:
	./e2e/chart-test.sh
	./scripts/krew-check.sh

# The shim built for musl and run in a musl process with the fake driver; installs the rustup
# target and Debian's musl-tools on first use (about a minute once).
musl:
	./libvgpu-shim/musl-test.sh

# Every benchmark of docs/benchmarks.md (about 13 minutes once built): rewrites its tables and
# docs/bench/*.csv. Release builds; needs what `make e2e` needs.
bench:
	bench/run.sh

# Each benchmark for a few seconds: proves they all still run; the figures mean nothing.
bench-quick:
	bench/run.sh --quick

fuzz-smoke:
	./fuzz/run.sh

# The release artifacts for linux/amd64 and linux/arm64 into dist/ (docs/release.md): binaries,
# one multi-platform OCI archive per image, SBOMs, the packaged chart, a values overlay pinning
# the images by digest, SHA256SUMS. About 25 minutes cold on two cores. release-check builds
# twice (the second from an empty target directory) and fails unless every file is identical.
release:
	./scripts/release.sh

release-check:
	./scripts/release.sh --check
