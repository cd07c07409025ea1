#!/usr/bin/env bash
# Builds every fuzz target and runs each for N iterations (default 20000).
#   fuzz/run.sh            # CI: a short run of each target
#   fuzz/run.sh 1000000    # the one-off million-iteration run
# Needs the nightly toolchain and cargo-fuzz (`cargo install cargo-fuzz --locked`).
# Respects CARGO_TARGET_DIR. Logs go to fuzz/artifacts/<target>.log, crashes to
# fuzz/artifacts/<target>/.
set -euo pipefail
runs="${1:-20000}"
cd "$(dirname "$0")"
targets=$(cargo +nightly fuzz list)
cargo +nightly fuzz build
mkdir -p artifacts
for t in $targets; do
    mkdir -p "corpus/$t"
    log="artifacts/$t.log"
    # -max_len keeps inputs annotation-sized; -timeout turns a hang into a failure.
    if ! cargo +nightly fuzz run "$t" "corpus/$t" -- -runs="$runs" -max_len=4096 -timeout=10 >"$log" 2>&1; then
        tail -n 60 "$log" >&2
        echo "fuzz target $t FAILED (log: fuzz/$log)" >&2
        exit 1
    fi
    echo "$t: $(grep -E '^Done [0-9]+ runs' "$log" || echo "finished (no summary line)")"
done
