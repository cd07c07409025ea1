# The README's two commands live here so that CI (.ci/run) and users run the same thing.
.PHONY: demo test lint unit fuzz-smoke

# Places the bundled example pods on the bundled example cluster, offline.
demo:
	cargo run --locked -p tessera-scheduler -- simulate -f examples/simulate/cluster.yaml

# The whole test suite, as CI runs it.
test: lint unit fuzz-smoke

lint:
	cargo fmt --all -- --check
	cargo clippy --locked --workspace --all-targets -- -D warnings

unit:
	cargo test --locked --workspace

fuzz-smoke:
	./fuzz/run.sh
