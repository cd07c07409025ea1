#!/usr/bin/env bash
# libvgpu.so in a musl process: builds the shim and the fake driver for the musl target
# (libvgpu-shim/musl-build.sh), compiles tests/c/cuda_probe.c with musl-gcc against the musl
# fake libcuda.so.1, and runs the probe under LD_PRELOAD of the musl shim the way
# tests/common/mod.rs runs it for glibc (clean environment, private region file,
# FAKE_CUDA_MEMORY_MIB=1024):
#
#   limit     allocation up to CUDA_DEVICE_MEMORY_LIMIT succeeds, one byte past is OOM, on
#             every allocation path (and the per-device variable overrides the fallback)
#   procaddr  the same through cuGetProcAddress_v2 (11000/12000/12080, with and without the
#             per-thread flag, and with a driver that returns internal entry points)
#   dlsym     dlsym(RTLD_NEXT, ...) stays relative to the caller; handle lookups are hooked
#   threads, fork
#   modpool   module loads and memory kept by pools count (and their control run)
#   graphmem  graph memory nodes are counted at instantiation (and its control run)
#   agnostic  cuGetProcAddress with a version-agnostic driver gives the v2 hooks in any order
#
# plus a control run of `limit` without the shim, which must fail (the probe really checks).
#
# Installs what is missing: the rustup target, and Debian's musl-tools (musl-gcc, the musl
# loader /lib/ld-musl-<arch>.so.1) with apt-get, which needs root (CI runs this as root).
# Exits non-zero on any failure, after printing the probe's output.
#
# Environment: TESSERA_MUSL_TARGET_DIR (default <repo>/target/musl), MUSL_PROFILE (debug or
# release, default debug).
set -euo pipefail

start=$(date +%s)
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
arch=$(uname -m)
triple=$arch-unknown-linux-musl
loader=/lib/ld-musl-$arch.so.1
target_dir=${TESSERA_MUSL_TARGET_DIR:-$root/target/musl}
profile=${MUSL_PROFILE:-debug}

say() { echo "musl-test: $*" >&2; }
die() {
    say "$*"
    exit 1
}

# --- prerequisites -------------------------------------------------------------------------
if ! rustup target list --installed | grep -qx "$triple"; then
    say "rustup target add $triple"
    rustup target add "$triple"
fi
if ! command -v musl-gcc >/dev/null 2>&1 || [ ! -x "$loader" ]; then
    [ "$(id -u)" = 0 ] || die "musl-gcc or $loader missing; run as root or apt-get install musl-tools"
    say "apt-get install musl-tools"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq musl-tools >/dev/null ||
        { apt-get update -qq && apt-get install -y -qq musl-tools >/dev/null; } ||
        die "apt-get install musl-tools failed"
fi

# --- build ---------------------------------------------------------------------------------
release=()
[ "$profile" = release ] && release=(--release)
TESSERA_MUSL_TARGET_DIR=$target_dir "$root/libvgpu-shim/musl-build.sh" --locked \
    "${release[@]}" -p libvgpu-shim -p fake-cuda
out=$target_dir/$triple/$profile
shim=$out/libvgpu.so
cuda=$out/libcuda.so
[ -f "$shim" ] && [ -f "$cuda" ] || die "no $shim or $cuda after the build"

# The shim needs musl's C library and nothing else (no libgcc_s, nothing from glibc).
needed=$(readelf -d "$shim" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | tr '\n' ' ')
[ "$needed" = "libc.so " ] || die "libvgpu.so needs [$needed], expected only libc.so"

# The same symbol surface as on glibc (tests/memory.rs pins the list): the hooks and dlsym, and
# none of the statically linked unwinder's.
extra=$(nm -D --defined-only "$shim" | awk '{print $3}' | grep -Ev '^(cu|nvml)[A-Za-z0-9_]+$|^dlsym$' || true)
[ -z "$extra" ] || die "libvgpu.so exports more than the hooks: $extra"

dir=$target_dir/musl-probe
mkdir -p "$dir"
for n in libcuda.so.1 libcuda.so; do ln -sf "$cuda" "$dir/$n"; done
probe=$dir/cuda_probe
musl-gcc -O1 -Wall -o "$probe" libvgpu-shim/tests/c/cuda_probe.c -L"$dir" -lcuda -ldl -lpthread
interp=$(readelf -l "$probe" | sed -n 's/.*Requesting program interpreter: \(.*\)]/\1/p')
[ "$interp" = "$loader" ] || die "the probe's interpreter is '$interp', not $loader"
# Every object of the process is musl's: the loader resolves the preload and the fake driver.
objects=$(env -i LD_LIBRARY_PATH="$dir" LD_PRELOAD="$shim" "$loader" --list "$probe" 2>&1) ||
    die "the musl loader cannot resolve the probe: $objects"
if grep -q 'libc\.so\.6\|ld-linux' <<<"$objects"; then die "glibc in the musl process: $objects"; fi
grep -q "libvgpu.so" <<<"$objects" || die "the shim is not loaded: $objects"

# --- runs ----------------------------------------------------------------------------------
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0
runs=0

# run NAME EXPECT(pass|fail) PRELOAD(yes|no) [VAR=VALUE...] -- PROBE ARGS...
run() {
    local name=$1 expect=$2 preload=$3
    shift 3
    local vars=()
    while [ "$1" != -- ]; do
        vars+=("$1")
        shift
    done
    shift
    local env=(env -i "PATH=$PATH" "LD_LIBRARY_PATH=$dir"
        "CUDA_DEVICE_MEMORY_SHARED_CACHE=$tmp/$runs.cache" FAKE_CUDA_MEMORY_MIB=1024)
    [ "$preload" = yes ] && env+=("LD_PRELOAD=$shim")
    runs=$((runs + 1))
    local output rc=0
    output=$("${env[@]}" "${vars[@]}" "$probe" "$@" 2>&1) || rc=$?
    if { [ "$expect" = pass ] && [ $rc = 0 ]; } || { [ "$expect" = fail ] && [ $rc != 0 ]; }; then
        echo "ok   $name"
    else
        echo "FAIL $name (exit $rc, expected to $expect)"
        sed 's/^/     | /' <<<"$output"
        failures=$((failures + 1))
    fi
}

limit=$((64 << 20))
run "limit 64m" pass yes CUDA_DEVICE_MEMORY_LIMIT=64m -- limit $limit
run "limit: CUDA_DEVICE_MEMORY_LIMIT_0 overrides" pass yes \
    CUDA_DEVICE_MEMORY_LIMIT=1g CUDA_DEVICE_MEMORY_LIMIT_0=65536k -- limit $limit
run "control: limit without the shim fails" fail no CUDA_DEVICE_MEMORY_LIMIT=64m -- limit $limit
for version in 11000 12000 12080; do
    for flags in 0 2; do
        run "procaddr $version flags $flags" pass yes CUDA_DEVICE_MEMORY_LIMIT=64m -- \
            procaddr $limit $version $flags
    done
done
for flags in 0 2; do
    run "procaddr internal entry points flags $flags" pass yes CUDA_DEVICE_MEMORY_LIMIT=64m \
        FAKE_CUDA_PROC_INTERNAL=1 -- procaddr $limit 12080 $flags
done
run "dlsym" pass yes -- dlsym
run "control: dlsym without the shim fails" fail no -- dlsym
run "threads" pass yes CUDA_DEVICE_MEMORY_LIMIT=64m -- threads $limit
run "fork" pass yes CUDA_DEVICE_MEMORY_LIMIT=64m -- fork $limit
# Module loads and pool memory (the ready file doubles as the go file: no checkpoint wait).
run "modpool" pass yes CUDA_DEVICE_MEMORY_LIMIT=64m -- modpool $limit "$tmp/ready" "$tmp/ready"
run "control: modpool without the shim fails" fail no -- modpool $limit "$tmp/ready" "$tmp/ready"
# Graph memory nodes counted at instantiation; cuGetProcAddress with a version-agnostic driver.
run "graphmem" pass yes CUDA_DEVICE_MEMORY_LIMIT=64m -- graphmem $limit
run "control: graphmem without the shim fails" fail no CUDA_DEVICE_MEMORY_LIMIT=64m -- graphmem $limit
for order in probe-first legacy-first direct; do
    run "agnostic cuGetProcAddress, $order" pass yes CUDA_DEVICE_MEMORY_LIMIT=64m \
        FAKE_CUDA_PROC_AGNOSTIC=1 FAKE_CUDA_PROC_INTERNAL=1 -- agnostic $limit $order
done

elapsed=$(($(date +%s) - start))
if [ $failures != 0 ]; then
    say "$failures of $runs runs failed (${elapsed}s)"
    exit 1
fi
say "all $runs runs passed in a musl process (${elapsed}s)"
