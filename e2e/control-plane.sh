#!/usr/bin/env bash
# Builds the upstream control plane the e2e tests run against, from released Go modules only:
#
#   ${TESSERA_CACHE:-$HOME/.cache/tessera}/k8s-<v>-r<recipe>/{kube-apiserver,kube-scheduler,
#                                                  kube-controller-manager,kubelet}
#   ${TESSERA_CACHE:-$HOME/.cache/tessera}/etcd-<v>/etcd
#   ${TESSERA_CACHE:-$HOME/.cache/tessera}/kube-scheduler-<next>-r1/kube-scheduler (a newer
#                                                  kube-scheduler, v1.38.0-beta.0, Go 1.27)
#
# k8s.io/kubernetes cannot be `go install`ed (its go.mod replaces every staging module with a
# local path), so a throw-away wrapper module requires it and replaces each staging module, read
# from the release's own go.mod, by the matching published v0.N.P. etcd gets a wrapper of its own
# so the two dependency graphs never mix. Binaries are moved into the cache only after a
# successful build; a second run finds them and costs nothing.
#
# Prints `NAME=PATH` lines on stdout (eval-able); progress goes to stderr.
set -euo pipefail

K8S_VERSION="${TESSERA_K8S_VERSION:-v1.34.4}"
ETCD_VERSION="${TESSERA_ETCD_VERSION:-v3.6.16}"
# Bump when the build recipe below changes, so stale binaries are never reused.
RECIPE=2

CACHE="${TESSERA_CACHE:-$HOME/.cache/tessera}"
K8S_DIR="$CACHE/k8s-$K8S_VERSION-r$RECIPE"
ETCD_DIR="$CACHE/etcd-$ETCD_VERSION-r1"
NEXT_SCHEDULER_VERSION="${TESSERA_NEXT_SCHEDULER_VERSION:-v1.38.0-beta.0}"
NEXT_SCHEDULER_TOOLCHAIN="${TESSERA_NEXT_SCHEDULER_TOOLCHAIN:-go1.27.4}"
NEXT_SCHEDULER_DIR="$CACHE/kube-scheduler-$NEXT_SCHEDULER_VERSION-r1"
# The control plane and the node agent, one `go build` (they share most packages).
K8S_BINARIES="kube-apiserver kube-scheduler kube-controller-manager kubelet"

log() { printf 'control-plane.sh: %s\n' "$*" >&2; }

command -v go >/dev/null 2>&1 || { log "error: the Go toolchain is required to build kube-apiserver, kube-scheduler and etcd"; exit 1; }
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
export CGO_ENABLED=0
export GOFLAGS="${GOFLAGS:-} -mod=mod"
export GOWORK=off
mkdir -p "$CACHE"

# build_k8s VERSION GO DIR BINARIES...: the named commands of k8s.io/kubernetes@VERSION into DIR,
# with the Go release GO (the wrapper module's `go` and `godebug` lines: upstream's own GODEBUG
# defaults for that release; only the main module's line counts).
build_k8s() {
	local version="$1" gover="$2" dir="$3"; shift 3
	local b missing=0
	for b in "$@"; do [[ -x "$dir/$b" ]] || missing=1; done
	[[ $missing == 1 ]] || return 0
	local minor="${version#v1.}"; minor="${minor%%.*}"
	local staging="v0.${version#v1.}"
	log "building $* $version from k8s.io/kubernetes (one-time cost, 20-30 min on 2 cores for all four)"
	local src
	src="$(mktemp -d "$CACHE/.k8s-src-XXXXXX")"
	trap 'rm -rf "$src"' RETURN
	cat >"$src/go.mod" <<GOMOD
module tessera.local/k8sbin
go $gover.0
godebug default=go$gover
GOMOD
	local gomod
	gomod="$(cd "$src" && go mod download -json "k8s.io/kubernetes@$version" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p')"
	[[ -f "$gomod" ]] || { log "error: go.mod of k8s.io/kubernetes@$version not found"; exit 1; }
	local replaces=()
	while read -r mod; do
		replaces+=("-replace=$mod=$mod@$staging")
	done < <(sed -n 's#^[[:space:]]*\(k8s\.io/[a-z0-9-]*\) => \./staging/src/k8s\.io/[a-z0-9-]*$#\1#p' "$gomod")
	[[ ${#replaces[@]} -gt 20 ]] || { log "error: found only ${#replaces[@]} staging modules in $gomod"; exit 1; }
	log "replacing ${#replaces[@]} staging modules with $staging"
	(cd "$src" && go mod edit "${replaces[@]}" "-require=k8s.io/kubernetes@$version")
	{
		printf '//go:build tools\n\npackage tools\n\nimport (\n'
		for b in "$@"; do printf '\t_ "k8s.io/kubernetes/cmd/%s"\n' "$b"; done
		printf ')\n'
	} >"$src/tools.go"
	(cd "$src" && go mod tidy >&2)
	local x=""
	for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
		x+=" -X $pkg.gitVersion=$version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
	done
	(cd "$src" && nice -n 19 go build -trimpath -tags=notest,grpcnotrace -ldflags "-s -w$x" -o "$src/bin/" \
		$(for b in "$@"; do printf 'k8s.io/kubernetes/cmd/%s ' "$b"; done) >&2)
	mkdir -p "$dir"
	for b in "$@"; do mv -f "$src/bin/$b" "$dir/"; done
}

build_etcd() {
	if [[ -x "$ETCD_DIR/etcd" ]]; then
		return 0
	fi
	log "building etcd $ETCD_VERSION from go.etcd.io/etcd/server/v3 (one-time cost, a few minutes)"
	local src
	src="$(mktemp -d "$CACHE/.etcd-src-XXXXXX")"
	trap 'rm -rf "$src"' RETURN
	cat >"$src/go.mod" <<GOMOD
module tessera.local/etcdbin

go 1.24.0
GOMOD
	cat >"$src/tools.go" <<'GOSRC'
//go:build tools

package tools

import _ "go.etcd.io/etcd/server/v3"
GOSRC
	(cd "$src" && go mod edit "-require=go.etcd.io/etcd/server/v3@$ETCD_VERSION" && go mod tidy >&2)
	(cd "$src" && nice -n 19 go build -trimpath -ldflags "-s -w" -o "$src/etcd" go.etcd.io/etcd/server/v3 >&2)
	mkdir -p "$ETCD_DIR"
	mv -f "$src/etcd" "$ETCD_DIR/etcd"
}

build_etcd
build_k8s "$K8S_VERSION" 1.24 "$K8S_DIR" $K8S_BINARIES
# A newer kube-scheduler beside the v1.34 control plane, for what only newer releases do
# (preemption candidates without victims for an extender, upstream PR #135486). Its go.mod needs
# Go 1.27: the toolchain comes from the Go module proxy, like the modules.
GOTOOLCHAIN="$NEXT_SCHEDULER_TOOLCHAIN" build_k8s "$NEXT_SCHEDULER_VERSION" 1.27 "$NEXT_SCHEDULER_DIR" kube-scheduler

echo "KUBE_APISERVER=$K8S_DIR/kube-apiserver"
echo "KUBE_SCHEDULER=$K8S_DIR/kube-scheduler"
echo "KUBE_CONTROLLER_MANAGER=$K8S_DIR/kube-controller-manager"
echo "KUBELET=$K8S_DIR/kubelet"
echo "ETCD=$ETCD_DIR/etcd"
echo "KUBE_SCHEDULER_NEXT=$NEXT_SCHEDULER_DIR/kube-scheduler"
echo "KUBE_SCHEDULER_NEXT_VERSION=$NEXT_SCHEDULER_VERSION"
echo "K8S_VERSION=$K8S_VERSION"
