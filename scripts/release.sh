#!/usr/bin/env bash
# `make release`: Tessera's release artifacts for linux/amd64 and linux/arm64, from the checked
# out commit, into dist/ (TESSERA_DIST overrides):
#
#   dist/bin/<arch>/           tessera-scheduler, tessera-device-plugin, tessera-dra-plugin,
#                              kubectl-tessera, libvgpu.so (glibc); libvgpu-musl.so (amd64);
#                              simulated/ (the simulated GPUs' fake driver and probe)
#   dist/images/<image>.tar    one OCI archive per image, an index of both architectures
#                              (tessera-scheduler, tessera-device-plugin, tessera-simulated-gpu,
#                              tessera-gpu-probe)
#   dist/kubectl-tessera-v<v>-linux-<arch>.tar.gz, dist/krew/tessera.yaml
#                              the kubectl plugin's archives and krew manifest
#   dist/sbom/<image>.cdx.json a CycloneDX SBOM per image
#   dist/tessera-<v>.tgz       the packaged chart; dist/values-digests.yaml pins its images by
#                              digest
#   dist/SHA256SUMS            every file above
#
# Reproducible: the binaries are built with the commit's time as SOURCE_DATE_EPOCH and every path
# remapped, the images carry no timestamps but the commit's, so two runs from the same commit
# give the same digests (scripts/release.sh --check builds twice and compares).
#
# Cross-compiling arm64: Rust's aarch64-unknown-linux-gnu standard library from rustup and
# Debian's gcc-aarch64-linux-gnu (linker, and C for ring); the image's libraries come from
# Debian's libc6-arm64-cross. The musl shim is built for amd64 only (Debian has no aarch64 musl
# toolchain). Installs what it needs with apt-get and rustup (root).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

log() { printf 'release.sh: %s\n' "$*" >&2; }
# krew_plugin: the kubectl plugin's archives and krew manifest (scripts/krew-check.sh runs it too).
# shellcheck source=scripts/krew-plugin.sh
. scripts/krew-plugin.sh

dist="${TESSERA_DIST:-$root/dist}"
arches="${TESSERA_RELEASE_ARCHES:-amd64 arm64}"
target_dir="${TESSERA_RELEASE_TARGET_DIR:-$HOME/.cache/tessera/release-target}"
check=false
[[ "${1:-}" == "--check" ]] && check=true

version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"/\1/p' Cargo.toml)
revision=$(git rev-parse HEAD)
epoch=$(git show -s --format=%ct HEAD)
build_date=$(date -u -d "@$epoch" +%Y-%m-%dT%H:%M:%SZ)
if [[ -n "$(git status --porcelain --untracked-files=no)" ]]; then
	log "warning: the work tree has changes: the artifacts are not those of $revision"
fi

triple_of() {
	case "$1" in
	amd64) echo x86_64-unknown-linux-gnu ;;
	arm64) echo aarch64-unknown-linux-gnu ;;
	*) log "error: unknown architecture $1 (amd64, arm64)"; exit 2 ;;
	esac
}

need_packages() {
	local need=()
	for p in "$@"; do
		dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || need+=("$p")
	done
	if [[ ${#need[@]} -gt 0 ]]; then
		[[ $(id -u) == 0 ]] || { log "error: installing ${need[*]} needs root"; exit 1; }
		log "installing ${need[*]} (once)"
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >&2 ||
			{ apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >&2; }
	fi
}

# zig and cargo-zigbuild from PyPI (their wheels carry the binaries), once, keyed by version.
zig_version="${TESSERA_ZIG_VERSION:-0.13.0}"
zigbuild_version="${TESSERA_CARGO_ZIGBUILD_VERSION:-0.24.0}"
zig_dir="$HOME/.cache/tessera/tools/ziglang-$zig_version/ziglang"
zigbuild="$HOME/.cache/tessera/tools/cargo-zigbuild-$zigbuild_version/bin/cargo-zigbuild"
zig_tools() {
	if [[ ! -x "$zig_dir/zig" ]]; then
		log "installing zig $zig_version from PyPI (once)"
		python3 -m pip install --quiet --target "$(dirname "$zig_dir")" "ziglang==$zig_version" >&2
	fi
	if [[ ! -x "$zigbuild" ]]; then
		log "installing cargo-zigbuild $zigbuild_version from PyPI (once)"
		python3 -m pip install --quiet --target "$(dirname "$(dirname "$zigbuild")")" "cargo-zigbuild==$zigbuild_version" >&2
	fi
}

# Paths into the build (the checkout, Cargo's registry, the toolchain) are remapped, so the
# binaries do not depend on where they were built.
remap="--remap-path-prefix=$root=/tessera --remap-path-prefix=${CARGO_HOME:-$HOME/.cargo}=/cargo --remap-path-prefix=${RUSTUP_HOME:-$HOME/.rustup}=/rustup"

# zigbuild_glibc_2_17 TRIPLE WHAT PACKAGE...: PACKAGEs in release against glibc 2.17 (zig's
# linker with 2.17's symbol versions, cargo-zigbuild) into $target_dir/shim-glibc; the Debian
# cross linker set for arm64 must not replace zig's.
zigbuild_glibc_2_17() {
	local triple="$1" what="$2" p
	shift 2
	local packages=()
	for p in "$@"; do packages+=(-p "$p"); done
	log "building the $what against glibc 2.17 (cargo-zigbuild)"
	SOURCE_DATE_EPOCH="$epoch" RUSTFLAGS="$remap" \
		CARGO_INCREMENTAL=0 CARGO_TARGET_DIR="$target_dir/shim-glibc" PATH="$zig_dir:$PATH" \
		env -u CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER -u CC_aarch64_unknown_linux_gnu nice -n 10 \
		"$zigbuild" zigbuild --locked --release --target "$triple.2.17" "${packages[@]}" >&2
}

# newer_than_glibc_2_17 WHAT FILE...: stops the release when a FILE needs a glibc symbol newer
# than 2.17 (printed above the error).
newer_than_glibc_2_17() {
	local what="$1"
	shift
	if readelf -W --dyn-syms "$@" | grep -Eo 'GLIBC_2\.(1[8-9]|[2-9][0-9])' | sort -u | grep .; then
		log "error: the $what need a glibc newer than 2.17 (above)"
		exit 1
	fi
}

# build_binaries ARCH OUT: the release binaries of ARCH into OUT.
build_binaries() {
	local arch="$1" out="$2" triple
	triple=$(triple_of "$arch")
	rustup target add "$triple" >&2
	if [[ "$arch" == arm64 ]]; then
		need_packages gcc-aarch64-linux-gnu libc6-dev-arm64-cross
		export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
		export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc
	fi
	log "building the $arch binaries ($triple, release) into $target_dir"
	SOURCE_DATE_EPOCH="$epoch" TESSERA_REVISION="$revision" TESSERA_BUILD_DATE="$build_date" \
		RUSTFLAGS="$remap" \
		CARGO_INCREMENTAL=0 CARGO_TARGET_DIR="$target_dir" nice -n 10 \
		cargo build --locked --release --target "$triple" \
		-p tessera-scheduler -p tessera-device-plugin -p tessera-dra-plugin -p kubectl-tessera >&2
	# The glibc shim is loaded into every GPU workload, whatever its distribution, so it links
	# against glibc 2.17 (as docker/device-plugin.Dockerfile's manylinux2014 stage does), not
	# this machine's 2.36.
	zig_tools
	zigbuild_glibc_2_17 "$triple" "$arch glibc shim" libvgpu-shim
	local glibc_2_17="$target_dir/shim-glibc/$triple/release"
	local shim="$glibc_2_17/libvgpu.so"
	# The simulated GPUs' fake driver (the chart's `simulatedGpus` image) is mapped into GPU
	# workloads of any distribution too: glibc 2.17 alike, built on its own so its crates'
	# features never reach the shim's build.
	zigbuild_glibc_2_17 "$triple" "$arch simulated GPUs' fake driver" fake-cuda fake-nvml
	newer_than_glibc_2_17 "$arch glibc shim and fake driver" "$shim" "$glibc_2_17/libcuda.so" "$glibc_2_17/libnvidia_ml.so"
	mkdir -p "$out"
	local rel="$target_dir/$triple/release"
	# The release profile keeps line tables for backtraces in development; the shipped files
	# keep their symbols (function names in backtraces) and drop the DWARF (about 4/5 of them).
	local objcopy=objcopy
	[[ "$arch" == arm64 ]] && objcopy=aarch64-linux-gnu-objcopy
	for b in tessera-scheduler tessera-device-plugin tessera-dra-plugin kubectl-tessera; do
		"$objcopy" --strip-debug "$rel/$b" "$out/$b"
	done
	"$objcopy" --strip-debug "$shim" "$out/libvgpu.so"
	mkdir -p "$out/simulated"
	"$objcopy" --strip-debug "$glibc_2_17/libcuda.so" "$out/simulated/libcuda.so.1"
	"$objcopy" --strip-debug "$glibc_2_17/libnvidia_ml.so" "$out/simulated/libnvidia-ml.so.1"
	# The simulated GPUs' example workload (the tessera-gpu-probe image): the CUDA probe, linked
	# against the fake libcuda.so.1 and glibc 2.17 by zig's C compiler.
	local zig_target=x86_64-linux-gnu.2.17
	[[ "$arch" == arm64 ]] && zig_target=aarch64-linux-gnu.2.17
	"$zig_dir/zig" cc -target "$zig_target" -O1 -Wall -ffile-prefix-map="$root=/tessera" \
		-o "$out/simulated/cuda_probe" libvgpu-shim/tests/c/cuda_probe.c \
		-L"$glibc_2_17" -lcuda -ldl -lpthread >&2
	if [[ "$arch" == amd64 ]]; then
		need_packages musl-tools
		SOURCE_DATE_EPOCH="$epoch" RUSTFLAGS="$remap" \
			CARGO_INCREMENTAL=0 TESSERA_MUSL_TARGET_DIR="$target_dir/musl" nice -n 10 \
			sh libvgpu-shim/musl-build.sh --locked --release -p libvgpu-shim >&2
		objcopy --strip-debug "$target_dir/musl/x86_64-unknown-linux-musl/release/libvgpu.so" "$out/libvgpu-musl.so"
	fi
}

# busybox ARCH: a static busybox of ARCH (Debian's busybox-static; arm64's downloaded once).
busybox() {
	case "$1" in
	amd64)
		need_packages busybox-static
		echo /bin/busybox
		;;
	arm64)
		local dir="$HOME/.cache/tessera/tools/busybox-static-arm64"
		if [[ ! -x "$dir/bin/busybox" ]]; then
			log "fetching Debian's busybox-static for arm64 (once)"
			dpkg --print-foreign-architectures | grep -qx arm64 || { dpkg --add-architecture arm64 && apt-get update -qq >&2; }
			local tmp
			tmp=$(mktemp -d)
			chmod 755 "$tmp"
			(cd "$tmp" && apt-get download busybox-static:arm64 >&2)
			rm -rf "$dir"
			dpkg-deb -x "$tmp"/busybox-static_*_arm64.deb "$dir"
			rm -rf "$tmp"
		fi
		echo "$dir/bin/busybox"
		;;
	esac
}

# assemble OUT: images, SBOMs, the chart and the checksums from OUT/bin.
assemble() {
	local out="$1"
	local args=()
	for arch in $arches; do
		args+=(--bin "$arch=$out/bin/$arch" --busybox "$arch=$(busybox "$arch")")
	done
	"$tool" images --version "$version" --revision "$revision" --created "$build_date" \
		"${args[@]}" --out "$out" >&2
	local helm
	helm=$(./e2e/tools.sh | sed -n 's/^HELM=//p')
	"$helm" package charts/tessera --version "$version" --app-version "$version" -d "$out" >&2
	# helm package stamps the archive entries with the current time: rewrite them with the
	# commit's, so the chart archive is reproducible too.
	"$tool" normalize-tgz --mtime "$epoch" "$out/tessera-$version.tgz" >&2
	krew_plugin "$out" "$version" "$epoch" "$arches"
	local files
	files=$(cd "$out" && find . -type f ! -name SHA256SUMS -printf '%P\n' | LC_ALL=C sort)
	(cd "$out" && xargs sha256sum <<<"$files") >"$out/.SHA256SUMS" && mv "$out/.SHA256SUMS" "$out/SHA256SUMS"
}

# The release tool (the e2e image builder; its speed does not matter: a debug build, in the
# workspace's usual target directory).
tool_dir="${CARGO_TARGET_DIR:-$root/target}"
tool="$tool_dir/debug/tessera-release"
build_tool() {
	log "building the release tool"
	CARGO_TARGET_DIR="$tool_dir" cargo build --locked -p tessera-e2e --bin tessera-release >&2
}

release_into() {
	local out="$1"
	rm -rf "$out"
	mkdir -p "$out/bin"
	for arch in $arches; do
		build_binaries "$arch" "$out/bin/$arch"
	done
	assemble "$out"
	log "artifacts of Tessera $version ($revision) in $out"
}

build_tool
if $check; then
	# Twice, the second from an empty target directory, and compare every file.
	release_into "$dist"
	first="$target_dir"
	target_dir="${target_dir}-check"
	rm -rf "$target_dir"
	release_into "$dist-check"
	if diff <(cd "$dist" && cat SHA256SUMS) <(cd "$dist-check" && cat SHA256SUMS); then
		log "reproducible: both builds give the same $(wc -l <"$dist/SHA256SUMS") files"
	else
		log "error: the two builds differ (above)"
		exit 1
	fi
	target_dir="$first"
else
	release_into "$dist"
fi
