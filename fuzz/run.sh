#!/usr/bin/env bash
# Builds every fuzz target and runs each for N iterations (default 20000).
#   fuzz/run.sh            # CI: a short run of each target
#   fuzz/run.sh 1000000    # the one-off million-iteration run
# Installs what it needs on first use: the nightly toolchain (libFuzzer's sanitizer flags need it)
# and cargo-fuzz.
# Respects CARGO_TARGET_DIR. Logs go to fuzz/artifacts/<target>.log, crashes to
# fuzz/artifacts/<target>/.
set -euo pipefail
runs="${1:-20000}"
cd "$(dirname "$0")"
rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked --version 0.13.2
targets=$(cargo +nightly fuzz list)
cargo +nightly fuzz build
mkdir -p artifacts
for t in $targets; do
    mkdir -p "corpus/$t"
    log="artifacts/$t.log"
    # -max_len keeps inputs annotation-sized; -timeout turns a hang into a failure.
    # New inputs go to corpus/<t> (ignored by git); seeds/<t> holds the contract's examples.
    if ! cargo +nightly fuzz run "$t" "corpus/$t" "seeds/$t" -- -runs="$runs" -max_len=4096 -timeout=10 >"$log" 2>&1; then
        tail -n 60 "$log" >&2
        echo "fuzz target $t FAILED (log: fuzz/$log)" >&2
        exit 1
    fi
    echo "$t: $(grep -E '^Done [0-9]+ runs' "$log" || echo "finished (no summary line)")"
done
