# syntax=docker/dockerfile:1.7
# tessera-device-plugin, plus the CUDA shim libvgpu.so for glibc and musl workloads and a static
# busybox that the chart's init container uses to install the shim on the node.
#
#   docker buildx build --platform linux/amd64,linux/arm64 \
#     -f docker/device-plugin.Dockerfile -t ghcr.io/tessera-gpu/tessera-device-plugin:0.1.0 .
#
# One invocation builds both architectures: the daemons and the glibc shim are cross-compiled on
# the builder's own platform, as `make release` does (docker/cross-env.sh; the shim with
# cargo-zigbuild against glibc 2.17), so nothing runs under emulation except the optional musl
# shim. Build context: the repository root. See docker/README.md for the layout of the image.

ARG RUST_VERSION=1.95.0
# zig and cargo-zigbuild, from PyPI (their wheels carry the binaries), as scripts/release.sh.
ARG ZIG_VERSION=0.13.0
ARG CARGO_ZIGBUILD_VERSION=0.24.0
ARG BUSYBOX_IMAGE=busybox:1.36.1-musl

# --- the daemons (glibc: they dlopen() the driver's libnvidia-ml.so.1) --------------------------
FROM --platform=$BUILDPLATFORM rust:${RUST_VERSION}-bookworm AS plugin
ARG TARGETARCH
WORKDIR /src
COPY docker/cross-env.sh /usr/local/bin/cross-env
RUN cross-env install "$TARGETARCH"
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target,id=tessera-device-plugin-target-$TARGETARCH \
    cross-env run "$TARGETARCH" cargo build --locked --release -p tessera-device-plugin -p tessera-dra-plugin \
 && t="target/$(cross-env triple "$TARGETARCH")/release" \
 && install -D -m 0755 "$t/tessera-device-plugin" /out/tessera-device-plugin \
 && install -D -m 0755 "$t/tessera-dra-plugin" /out/tessera-dra-plugin

# --- libvgpu.so for glibc workloads (glibc 2.17 baseline) ---------------------------------------
# The shim is loaded into every GPU workload, whatever its distribution, so it is linked with
# glibc 2.17's symbol versions (zig's linker, `--target <triple>.2.17`) rather than the builder's:
# a shim built on Debian 12 needs GLIBC_2.34 and fails to load in Ubuntu 20.04 / RHEL 8 CUDA
# images. The last step refuses a shim that asks for anything newer.
FROM --platform=$BUILDPLATFORM rust:${RUST_VERSION}-bookworm AS shim-glibc
ARG TARGETARCH
ARG ZIG_VERSION
ARG CARGO_ZIGBUILD_VERSION
RUN apt-get update && apt-get install -y --no-install-recommends python3-pip \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m pip install --break-system-packages --no-cache-dir \
      "ziglang==${ZIG_VERSION}" "cargo-zigbuild==${CARGO_ZIGBUILD_VERSION}"
WORKDIR /src
COPY docker/cross-env.sh /usr/local/bin/cross-env
RUN rustup target add "$(cross-env triple "$TARGETARCH")"
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target,id=tessera-shim-glibc-target-$TARGETARCH \
    triple="$(cross-env triple "$TARGETARCH")" \
 && cargo zigbuild --locked --release -p libvgpu-shim --target "$triple.2.17" \
 && install -D -m 0644 "target/$triple/release/libvgpu.so" /out/libvgpu.so \
 && if readelf --dyn-syms -W /out/libvgpu.so | grep -Eo 'GLIBC_2\.(1[8-9]|[2-9][0-9])' | sort -u | grep .; then \
      echo "libvgpu.so needs a glibc newer than 2.17" >&2; exit 1; fi

# --- libvgpu.so for musl (Alpine) workloads ----------------------------------------------------
# musl's loader ignores /etc/ld.so.preload: such workloads load the shim with
# LD_PRELOAD=/usr/local/vgpu/musl/libvgpu.so (see docker/README.md).
# Off by default; build with --build-arg SHIM_MUSL=1. The stage then fails loudly if the build
# fails, never ships a stale file. libvgpu-shim/musl-build.sh is the same script CI's
# libvgpu-shim/musl-test.sh builds with: for this machine's <arch>-unknown-linux-musl, the C
# library linked dynamically (-crt-static: a musl cdylib must) and the unwinder statically, so the
# library needs nothing but musl's libc (no libgcc_s: Alpine images need not have libgcc), which
# the last step checks.
FROM rust:${RUST_VERSION}-alpine AS shim-musl
ARG SHIM_MUSL=0
RUN apk add --no-cache musl-dev gcc binutils
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target,id=tessera-shim-musl-target \
    mkdir -p /out \
 && if [ "$SHIM_MUSL" = 1 ]; then \
      set -e; \
      TESSERA_MUSL_TARGET_DIR=/src/target/musl sh libvgpu-shim/musl-build.sh --locked --release -p libvgpu-shim; \
      install -D -m 0644 "target/musl/$(uname -m)-unknown-linux-musl/release/libvgpu.so" /out/libvgpu.so; \
      readelf -d /out/libvgpu.so | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' > /tmp/needed; \
      if grep -v -e '^libc\.so$' -e '^libc\.musl-' /tmp/needed; then \
        echo "the musl libvgpu.so needs more than musl's libc (above)" >&2; exit 1; fi; \
    fi

FROM ${BUSYBOX_IMAGE} AS busybox

# --- runtime: glibc, no shell; runs as root (the DaemonSet is privileged for NVML and the
# kubelet sockets) -------------------------------------------------------------------------------
FROM gcr.io/distroless/cc-debian12
COPY --from=plugin /out/tessera-device-plugin /usr/bin/tessera-device-plugin
COPY --from=plugin /out/tessera-dra-plugin /usr/bin/tessera-dra-plugin
COPY --from=shim-glibc /out/libvgpu.so /opt/tessera/lib/libvgpu.so
# Empty unless built with SHIM_MUSL=1; the init container installs it only when present.
COPY --from=shim-musl /out/ /opt/tessera/lib/musl/
# Statically linked; only the chart's install-vgpu-hook init container runs it.
COPY --from=busybox /bin/busybox /opt/tessera/bin/busybox
EXPOSE 9394
ENTRYPOINT ["/usr/bin/tessera-device-plugin"]
