# syntax=docker/dockerfile:1.7
# tessera-scheduler: kube-scheduler extender + admission webhook.
#
#   docker buildx build --platform linux/amd64,linux/arm64 \
#     -f docker/scheduler.Dockerfile -t ghcr.io/tessera-gpu/tessera-scheduler:0.1.0 .
#
# One invocation builds both architectures: the build stage runs on the builder's own platform and
# cross-compiles for each target (Debian's aarch64 cross gcc, as `make release` does), so nothing
# runs under emulation. Build context: the repository root. See docker/README.md.

ARG RUST_VERSION=1.95.0

FROM --platform=$BUILDPLATFORM rust:${RUST_VERSION}-bookworm AS build
ARG TARGETARCH
WORKDIR /src
COPY docker/cross-env.sh /usr/local/bin/cross-env
RUN cross-env install "$TARGETARCH"
# Everything the workspace needs to resolve; the daemon is built with --locked.
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target,id=tessera-scheduler-target-$TARGETARCH \
    cross-env run "$TARGETARCH" cargo build --locked --release -p tessera-scheduler --bin tessera-scheduler \
 && install -D -m 0755 "target/$(cross-env triple "$TARGETARCH")/release/tessera-scheduler" /out/tessera-scheduler

# glibc runtime without a shell or package manager (Debian 12, the cross gcc's glibc), non-root.
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/tessera-scheduler /usr/bin/tessera-scheduler
USER 65532:65532
# The chart binds 443 as this user through the net.ipv4.ip_unprivileged_port_start sysctl.
EXPOSE 443 9395
ENTRYPOINT ["/usr/bin/tessera-scheduler"]
CMD ["serve"]
