#!/bin/sh
# The Dockerfiles' cross-compilation, one place: Docker's TARGETARCH (amd64, arm64) to Rust's
# target triple, the toolchain pieces it needs on a Debian 12 builder, and the environment Cargo
# and the C compiler (ring's C code) need for it. The choices are `make release`'s
# (scripts/release.sh): Rust's gnu target from rustup, Debian's cross gcc as linker.
#
#   cross-env triple  <arch>          prints the triple
#   cross-env install <arch>          rustup target and apt packages (once, in the build stage)
#   cross-env run     <arch> CMD...   runs CMD with --target's environment (cargo build gets
#                                     --target from CARGO_BUILD_TARGET)
set -eu
cmd="$1"
arch="$2"
shift 2
case "$arch" in
amd64) triple=x86_64-unknown-linux-gnu gcc=x86_64-linux-gnu-gcc pkgs="gcc-x86-64-linux-gnu libc6-dev-amd64-cross" ;;
arm64) triple=aarch64-unknown-linux-gnu gcc=aarch64-linux-gnu-gcc pkgs="gcc-aarch64-linux-gnu libc6-dev-arm64-cross" ;;
*)
	echo "cross-env: unsupported architecture $arch (amd64 or arm64)" >&2
	exit 1
	;;
esac
case "$cmd" in
triple) echo "$triple" ;;
install)
	rustup target add "$triple"
	# The builder's own architecture needs no cross compiler.
	if [ "$(dpkg --print-architecture)" != "$arch" ]; then
		apt-get update
		# shellcheck disable=SC2086
		apt-get install -y --no-install-recommends $pkgs
		rm -rf /var/lib/apt/lists/*
	fi
	;;
run)
	upper="$(echo "$triple" | tr 'a-z-' 'A-Z_')"
	under="$(echo "$triple" | tr '-' '_')"
	if [ "$(dpkg --print-architecture)" != "$arch" ]; then
		export "CARGO_TARGET_${upper}_LINKER=$gcc" "CC_${under}=$gcc"
	fi
	CARGO_BUILD_TARGET="$triple" exec "$@"
	;;
*)
	echo "cross-env: unknown command $cmd" >&2
	exit 1
	;;
esac
