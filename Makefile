# The README's two commands live here so that CI (.ci/run) and users run the same thing.
.PHONY: demo test lint unit chart fuzz-smoke

# Places the bundled example pods on the bundled example cluster, offline.
demo:
	cargo run --locked -p tessera-scheduler -- simulate -f examples/simulate/cluster.yaml

# The whole test suite, as CI runs it.
test: lint unit chart fuzz-smoke

lint:
	cargo fmt --all -- --check
	cargo clippy --locked --workspace --all-targets -- -D warnings

unit:
	cargo test --locked --workspace

# Helm lint/template/kubeconform on the chart; builds pinned helm and kubeconform with Go into
# ~/.cache/tessera on first use (about 5 minutes once). Runs after `unit` so that the daemons'
# binaries exist and the chart's flags are checked against them.
chart:
	./e2e/chart-test.sh

fuzz-smoke:
	./fuzz/run.sh
