#!/usr/bin/env bash
# Runs every benchmark of issue 7 and writes one CSV per benchmark plus the tables of
# docs/benchmarks.md (between its `<!-- bench:NAME -->` markers; the prose around them is kept).
#
#   bench/run.sh            full run: docs/bench/*.csv, docs/benchmarks.md updated (about 11 min
#                           on 2 cores once built)
#   bench/run.sh --quick    each benchmark for a few seconds, CSVs under target/bench-quick/,
#                           docs untouched; fails only if a benchmark fails or writes no rows
#   bench/run.sh --only filter,scheduling   a subset (names: the STEPS below); rewrites only
#                           those tables
#
# Needs what `make e2e` needs (the control plane from e2e/control-plane.sh, helm from
# e2e/tools.sh, both cached in ~/.cache/tessera), a C compiler, and valgrind for the shim's
# instruction counts (skipped with a note when absent). Logs: target/bench-logs/<name>.log.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

quick=0
only=""
while [ $# -gt 0 ]; do
    case "$1" in
    --quick) quick=1 ;;
    --only) only="$2"; shift ;;
    --only=*) only="${1#--only=}" ;;
    -h | --help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
    shift
done

if [ "$quick" = 1 ]; then
    out="$root/target/bench-quick"
else
    out="$root/docs/bench"
fi
logs="$root/target/bench-logs"
mkdir -p "$out" "$logs"

commit=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
# Changes to the runner's own outputs do not make the measured code "uncommitted".
if ! git diff --quiet HEAD -- . ':!docs/benchmarks.md' ':!docs/bench' 2>/dev/null; then
    commit="$commit+uncommitted"
fi
cpu=$(awk -F': ' '/^model name/ {print $2; exit}' /proc/cpuinfo 2>/dev/null || echo "?")
mem=$(awk '/^MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo 2>/dev/null || echo "?")
machine="$(nproc) vCPU ($cpu), $mem RAM, Linux $(uname -r)"
export TESSERA_BENCH_CSV_DIR="$out" TESSERA_BENCH_COMMIT="$commit" TESSERA_BENCH_MACHINE="$machine"
export TESSERA_BENCH_QUICK="$quick"
# The e2e benchmarks run the release daemons.
export TESSERA_E2E_PROFILE=release
export CRITERION_HOME="$root/target/criterion"

# name | command (run from the repository root). Full and quick forms differ only where noted.
mem_args="--nodes 1000 --pods 10000"
mem_scale_args="--nodes 5000 --pods 50000"
# HAMi's write order (h) is compared at 500 nodes (the scheduling step); at 5,000 it would add a
# quarter of an hour for no new question.
sched_scale_args="--nodes 5000 --pods 20000 --running 50000 --rounds 1 --burst 0 --variants plain,tessera,plain-qps1000,tessera-qps1000"
# Issue 29's T3: placement with the creates out of the way (pods created behind a scheduling gate,
# the gates lifted together), the Tessera variants against plain kube-scheduler at both QPS, and
# at QPS 1000 with the admission policies in place of the webhook (admissionPolicy.podMutation),
# and the same shares through DRA (a ResourceClaim per pod, no extender) against the same plain pods.
sched_gated_args="--gated --burst 0 --variants plain,tessera,dra,plain-qps1000,tessera-qps1000,tessera-policy-qps1000,dra-qps1000"
# T3 and T2 at 5,000 nodes: the QPS 1000 variants (where the goal is not met at 500 nodes; at the
# default QPS the client's rate limit, not the extender, sets plain's pace), 2,000 pods a run as at
# 500 nodes (DRA places under 40 pods/s: 5,000 pods a run would take most of an hour).
sched_gated_scale_args="--gated --nodes 5000 --pods 2000 --burst 0 --admission 0 --variants plain-qps1000,tessera-qps1000,dra-qps1000"
# API Priority and Fairness: the same gated placement at QPS 1000 with the components outside
# system:masters, classified under the chart's FlowSchemas (the other steps' identities are exempt).
sched_gated_apf_args="--gated --burst 0 --admission 0 --apf --variants plain-qps1000,tessera-qps1000"
if [ "$quick" = 1 ]; then
    mem_args="--nodes 100 --pods 1000"
    mem_scale_args="--nodes 200 --pods 2000"
    sched_scale_args="--nodes 100 --pods 300 --running 1000 --rounds 1 --burst 0"
    sched_gated_args="--gated --burst 0 --variants plain-qps1000,tessera-qps1000,tessera-policy-qps1000,dra-qps1000"
fi
STEPS=(
    "filter|cargo bench --locked -q -p tessera-scheduler --bench filter"
    "filter_latency|cargo bench --locked -q -p tessera-scheduler --bench filter_latency"
    "memory|cargo bench --locked -q -p tessera-scheduler --bench memory -- $mem_args"
    "memory_scale|cargo bench --locked -q -p tessera-scheduler --bench memory -- $mem_scale_args"
    "preempt_latency|cargo bench --locked -q -p tessera-scheduler --bench preempt_latency"
    "allocate_latency|cargo bench --locked -q -p tessera-node --bench allocate_latency"
    "device_plugin|cargo bench --locked -q -p tessera-e2e --bench device_plugin"
    "shim_overhead|cargo bench --locked -q -p libvgpu-shim --bench overhead"
    "shim_limiter|cargo test --locked -q --release -p libvgpu-shim --test limiter -- --nocapture"
    "scheduling|cargo bench --locked -q -p tessera-e2e --bench scheduling -- --admission 0"
    "scheduling_scale|cargo bench --locked -q -p tessera-e2e --bench scheduling -- --csv scheduling_scale $sched_scale_args"
    "scheduling_gated|cargo bench --locked -q -p tessera-e2e --bench scheduling -- --csv scheduling_gated $sched_gated_args"
    "scheduling_gated_scale|cargo bench --locked -q -p tessera-e2e --bench scheduling -- --csv scheduling_gated_scale $sched_gated_scale_args"
    "scheduling_gated_apf|cargo bench --locked -q -p tessera-e2e --bench scheduling -- --csv scheduling_gated_apf $sched_gated_apf_args"
    "real_burst|cargo bench --locked -q -p tessera-e2e --bench real_burst"
    "dra_burst|cargo bench --locked -q -p tessera-e2e --bench dra_burst"
)
# The CSV each step writes (memory_scale appends to memory.csv).
csv_of() {
    case "$1" in
    memory_scale) echo memory ;;
    *) echo "$1" ;;
    esac
}

selected() {
    [ -z "$only" ] && return 0
    local n=$1
    # Both memory sizes write memory.csv: they run together.
    [ "$n" = memory_scale ] && n=memory
    case ",$only," in *",$n,"*) return 0 ;; esac
    return 1
}

started=$(date +%s)
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
echo "bench: commit $commit; $machine; load $load_before; results in $out"

echo "bench: building the release daemons, the shim and the fake driver (for the e2e benchmarks)"
cargo build --locked -q --release -p tessera-scheduler -p tessera-device-plugin -p tessera-dra-plugin -p fake-nvml \
    -p fake-cuda -p libvgpu-shim

# Fresh CSVs for the steps that run.
for s in "${STEPS[@]}"; do
    name=${s%%|*}
    if selected "$name"; then rm -f "$out/$(csv_of "$name").csv"; fi
done

failed=()
declare -A took
for s in "${STEPS[@]}"; do
    name=${s%%|*}
    cmd=${s#*|}
    selected "$name" || continue
    if [ "$quick" = 1 ] && [ "$name" = scheduling_gated_scale ]; then
        # The same code as scheduling_gated's quick form, at a size only the full run needs.
        echo "bench: [$name] skipped in the quick form (scheduling_gated runs its code)"
        continue
    fi
    echo "bench: [$name] $cmd"
    t0=$(date +%s)
    if bash -c "$cmd" >"$logs/$name.log" 2>&1; then
        took[$name]=$(($(date +%s) - t0))
        echo "bench: [$name] done in ${took[$name]} s"
    else
        took[$name]=$(($(date +%s) - t0))
        echo "bench: [$name] FAILED after ${took[$name]} s; last lines of $logs/$name.log:" >&2
        tail -n 15 "$logs/$name.log" >&2
        failed+=("$name")
        continue
    fi
    if [ ! -s "$out/$(csv_of "$name").csv" ]; then
        echo "bench: [$name] wrote no rows to $out/$(csv_of "$name").csv" >&2
        failed+=("$name")
    fi
done
elapsed=$(($(date +%s) - started))
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

if [ "$quick" = 0 ]; then
    gen=$(mktemp -d)
    trap 'rm -rf "$gen"' EXIT
    [ -z "$only" ] && {
        echo "Last full run: commit \`$commit\`, $(date -u +%Y-%m-%d), $machine; load average"
        echo "$load_before at the start and $load_after at the end; $((elapsed / 60)) min $((elapsed % 60)) s."
        echo "Command: \`bench/run.sh\` (CSV per benchmark in \`docs/bench/\`, logs in \`target/bench-logs/\`)."
    } >"$gen/run.md"
    # The command as a person would type it (the runner's environment made explicit).
    shown() {
        local c=${1/ -q / }
        case "$c" in *tessera-e2e*) c="TESSERA_E2E_PROFILE=release $c" ;; esac
        echo "\`$c\`"
    }
    for s in "${STEPS[@]}"; do
        name=${s%%|*}
        cmd=${s#*|}
        csv=$(csv_of "$name")
        [ "$name" = memory_scale ] && continue
        selected "$name" || continue
        [ -s "$out/$csv.csv" ] || continue
        {
            if [ "$name" = memory ]; then
                echo "Commands: $(shown "$cmd") and $(shown "${STEPS[3]#*|}")"
            else
                echo "Command: $(shown "$cmd")"
            fi
            echo "(rows: \`docs/bench/$csv.csv\`; commit \`$commit\`, $(date -u +%Y-%m-%d), ${took[$name]:-?} s)."
            echo
            awk -f bench/report.awk "$out/$csv.csv"
        } >"$gen/$csv.md"
    done
    awk -v dir="$gen" -f bench/splice.awk docs/benchmarks.md >"$gen/page.md"
    cp "$gen/page.md" docs/benchmarks.md
    echo "bench: docs/benchmarks.md tables updated"
fi

echo "bench: finished in ${elapsed} s; load average $load_after"
if [ ${#failed[@]} -gt 0 ]; then
    echo "bench: failed: ${failed[*]}" >&2
    exit 1
fi
