# syntax=docker/dockerfile:1.7
# tessera-scheduler: kube-scheduler extender + admission webhook.
#
#   docker build -f docker/scheduler.Dockerfile -t ghcr.io/tessera-gpu/tessera-scheduler:0.1.0 .
#
# Build context: the repository root. Multi-arch: `docker buildx build --platform
# linux/amd64,linux/arm64 ...` (each platform builds natively or under emulation; no cross
# toolchain is needed). See docker/README.md.

ARG RUST_VERSION=1.95.0

FROM rust:${RUST_VERSION}-bookworm AS build
WORKDIR /src
# Everything the workspace needs to resolve; the daemon is built with --locked.
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target,id=tessera-scheduler-target \
    cargo build --locked --release -p tessera-scheduler --bin tessera-scheduler \
 && install -D -m 0755 target/release/tessera-scheduler /out/tessera-scheduler

# glibc runtime without a shell or package manager (Debian 12, the builder's glibc), non-root.
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/tessera-scheduler /usr/bin/tessera-scheduler
USER 65532:65532
# The chart binds 443 as this user through the net.ipv4.ip_unprivileged_port_start sysctl.
EXPOSE 443 9395
ENTRYPOINT ["/usr/bin/tessera-scheduler"]
CMD ["serve"]
