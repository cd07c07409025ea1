#!/bin/sh
# Builds workspace crates for this machine's musl target, as dynamically linked libraries:
#
#   libvgpu-shim/musl-build.sh --locked --release -p libvgpu-shim
#   → $TESSERA_MUSL_TARGET_DIR/<arch>-unknown-linux-musl/release/libvgpu.so
#
# Used by libvgpu-shim/musl-test.sh (on a glibc host, with Debian's musl-gcc) and by the musl
# stage of docker/device-plugin.Dockerfile (on Alpine, with its gcc). POSIX sh: Alpine has no
# bash.
#
# * `-C target-feature=-crt-static`: Rust's musl targets link statically by default and then
#   silently drop a `cdylib`; a shared object must link the C library dynamically.
# * The unwinder is linked statically. With `-crt-static`, Rust's `unwind` crate links
#   `-lgcc_s`, which is a glibc library on a glibc host (the musl loader would not find it) and
#   on Alpine lives in the `libgcc` package, which a workload image need not have. A directory
#   holding `libgcc_s.a` (a link to the LLVM libunwind that rustup ships for the musl target,
#   position-independent) comes first on the library path, so `-lgcc_s` links it in; the cdylib's
#   version script keeps its symbols local. The result needs only musl's `libc.so`.
# * On a glibc host the linker is `musl-gcc` (Debian's `musl-tools`; `MUSL_LINKER` overrides);
#   on a musl host, the default `cc`.
#
# Environment: TESSERA_MUSL_TARGET_DIR (default <repo>/target/musl, its own dir so that it never
# waits on another build's lock), MUSL_TARGET (default <arch>-unknown-linux-musl).
set -eu

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
triple=${MUSL_TARGET:-$(uname -m)-unknown-linux-musl}
target_dir=${TESSERA_MUSL_TARGET_DIR:-$root/target/musl}

sysroot=$(rustc --print sysroot)
unwind=$sysroot/lib/rustlib/$triple/lib/self-contained/libunwind.a
if [ ! -f "$unwind" ]; then
    echo "musl-build: $unwind is missing (rustup target add $triple)" >&2
    exit 1
fi
mkdir -p "$target_dir/musl-unwind"
ln -sf "$unwind" "$target_dir/musl-unwind/libgcc_s.a"

host=$(rustc -vV | sed -n 's/^host: //p')
case $host in
*-musl*) ;;
*)
    linker=${MUSL_LINKER:-musl-gcc}
    if ! command -v "$linker" >/dev/null 2>&1; then
        echo "musl-build: no $linker on a $host host (apt-get install musl-tools)" >&2
        exit 1
    fi
    var=CARGO_TARGET_$(echo "$triple" | tr 'a-z-' 'A-Z_')_LINKER
    export "$var=$linker"
    ;;
esac

RUSTFLAGS="${RUSTFLAGS:-} -C target-feature=-crt-static -L native=$target_dir/musl-unwind"
CARGO_TARGET_DIR=$target_dir
export RUSTFLAGS CARGO_TARGET_DIR
exec cargo build --target "$triple" "$@"
