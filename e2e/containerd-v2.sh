#!/usr/bin/env bash
# Builds containerd v2 (containerd, ctr, containerd-shim-runc-v2) from its released Go module,
# offline except for the Go module proxy:
#
#   ${TESSERA_CACHE:-$HOME/.cache/tessera}/containerd-<v>/bin/{containerd,ctr,containerd-shim-runc-v2}
#
# Why: Debian's containerd 1.6 (node-tools.sh) ignores the CRI `CDI_devices` field, so DRA pods
# get no CDI devices; containerd >= 1.7 applies them, and v2 enables CDI by default (spec dirs
# /etc/cdi and /var/run/cdi).
#
# The binaries are built as upstream's `make STATIC=1` does (CGO_ENABLED=0; tags urfave_cli_no_docs
# osusergo netgo static_build, plus no_grpc for the shim), leaving out the btrfs, devmapper and
# zfs snapshotters (only overlayfs and native are used). `go install <pkg>@<v>` builds with the
# module's own go.mod (it has no replace directives). Binaries are moved into the cache only after
# a successful build; a second run finds them and costs nothing.
#
# The shim: containerd looks a runtime's shim up on PATH first (exec.LookPath), and only when it is
# not found there, beside its own executable. Debian's containerd package installs
# /usr/bin/containerd-shim-runc-v2 (1.6's), which would win; so either put the directory of
# SHIM_V2 first on containerd's PATH, or name it in the CRI runtime's `runtime_path`.
#
# Prints `NAME=PATH` lines on stdout (eval-able); progress goes to stderr.
set -euo pipefail

CONTAINERD_VERSION="${TESSERA_CONTAINERD_VERSION:-v2.2.9}"
MODULE=github.com/containerd/containerd/v2

CACHE="${TESSERA_CACHE:-$HOME/.cache/tessera}"
DIR="$CACHE/containerd-$CONTAINERD_VERSION/bin"
BINARIES="containerd ctr containerd-shim-runc-v2"

log() { printf 'containerd-v2.sh: %s\n' "$*" >&2; }

command -v go >/dev/null 2>&1 || { log "error: the Go toolchain is required to build containerd"; exit 1; }
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
export CGO_ENABLED=0
export GOWORK=off
mkdir -p "$CACHE"

build_containerd() {
	local b missing=0
	for b in $BINARIES; do [[ -x "$DIR/$b" ]] || missing=1; done
	[[ $missing == 1 ]] || return 0
	log "building $BINARIES $CONTAINERD_VERSION from $MODULE (one-time cost, several minutes on 2 cores)"
	local tmp
	tmp="$(mktemp -d "$CACHE/.containerd-build-XXXXXX")"
	trap 'rm -rf "$tmp"' RETURN
	local tags="urfave_cli_no_docs osusergo netgo static_build no_btrfs no_devmapper no_zfs"
	local ldflags="-s -w -X $MODULE/version.Version=$CONTAINERD_VERSION -X $MODULE/version.Package=$MODULE"
	GOBIN="$tmp" nice -n 19 go install -trimpath -tags "$tags" -ldflags "$ldflags" \
		"$MODULE/cmd/containerd@$CONTAINERD_VERSION" "$MODULE/cmd/ctr@$CONTAINERD_VERSION" >&2
	# The shim as upstream builds it: without the gRPC service stubs (it speaks ttrpc).
	GOBIN="$tmp" nice -n 19 go install -trimpath -tags "$tags no_grpc" -ldflags "$ldflags" \
		"$MODULE/cmd/containerd-shim-runc-v2@$CONTAINERD_VERSION" >&2
	mkdir -p "$DIR"
	for b in $BINARIES; do mv -f "$tmp/$b" "$DIR/$b"; done
}

build_containerd

echo "CONTAINERD_V2=$DIR/containerd"
echo "CTR_V2=$DIR/ctr"
echo "SHIM_V2=$DIR/containerd-shim-runc-v2"
echo "CONTAINERD_V2_VERSION=$CONTAINERD_VERSION"
