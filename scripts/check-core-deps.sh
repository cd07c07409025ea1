#!/usr/bin/env bash
# Fails when a crate that must stay free of I/O pulls an I/O crate into its build:
# tessera-scheduler-core (the scheduler's pure decisions), tessera-node-core (the node's), hami-contract (the shared codecs) and
# vgpu-region (the shared-region layout and the monitor's feedback decision).
# Normal and build dependencies only: tests and benchmarks may use anything.
#
#   scripts/check-core-deps.sh
#
# Offline: run it after a build has fetched the crates.
set -euo pipefail
cd "$(dirname "$0")/.."

# Crates that do I/O or bring an async runtime, a client or a server.
io_crates=(
    kube kube-client kube-runtime
    tokio axum hyper tower
    rustls tokio-rustls
    tonic prometheus-client tracing-subscriber nvml-wrapper reqwest mio socket2
)
pure_crates=(tessera-scheduler-core tessera-node-core hami-contract vgpu-region)

pattern="^($(IFS='|'; echo "${io_crates[*]}")) v"
status=0
for crate in "${pure_crates[@]}"; do
    if ! tree=$(cargo tree --offline -p "$crate" -e normal,build --prefix none 2>&1); then
        echo "check-core-deps: cargo tree -p $crate failed:" >&2
        echo "$tree" >&2
        exit 2
    fi
    # `(*)` marks a crate already listed: one line per crate.
    found=$(grep -E "$pattern" <<<"$tree" | sed 's/ (\*)$//' | sort -u || true)
    if [ -n "$found" ]; then
        echo "check-core-deps: $crate must not depend on I/O crates, but its tree has:" >&2
        sed 's/^/    /' <<<"$found" >&2
        echo "  (see who pulls them in: cargo tree -p $crate -e normal,build -i <crate>)" >&2
        status=1
    else
        echo "check-core-deps: $crate: no I/O crate in its normal and build dependencies"
    fi
done
exit "$status"
