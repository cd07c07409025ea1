#!/usr/bin/env bash
# Installs what a real e2e node runs, from Debian's packages, once:
#
#   containerd 1.6 + runc (the container runtime a kubelet drives through CRI),
#   containernetworking-plugins (bridge, host-local, loopback: pod networking),
#   busybox-static (the shell inside the e2e images), iproute2 (the test's network namespace).
#
# Debian's packages rather than Go modules: they are what a Debian node runs, they install in
# about a minute, and containerd 1.6 serves everything the device-plugin path needs. DRA nodes
# need CDI (containerd >= 1.7): e2e/containerd-v2.sh builds containerd v2 for them. The kubelet
# and kube-controller-manager are built from their Go modules by control-plane.sh, beside
# kube-apiserver.
#
# Needs root (apt-get). Prints `NAME=PATH` lines on stdout (eval-able); progress goes to stderr.
set -euo pipefail

log() { printf 'node-tools.sh: %s\n' "$*" >&2; }

PACKAGES=(containerd runc containernetworking-plugins busybox-static iproute2)
need=()
for p in "${PACKAGES[@]}"; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || need+=("$p")
done
if [[ ${#need[@]} -gt 0 ]]; then
	[[ $(id -u) == 0 ]] || { log "error: installing ${need[*]} needs root"; exit 1; }
	log "installing ${need[*]} (one-time, about a minute)"
	export DEBIAN_FRONTEND=noninteractive
	# A fresh machine's first fetch has failed on a name that did not resolve for a moment
	# (Temporary failure resolving 'deb.debian.org'): try again before failing the suite.
	for attempt in 1 2 3; do
		if apt-get update -qq >&2 && apt-get install -y -qq --no-install-recommends "${need[@]}" >&2; then
			break
		fi
		[[ $attempt == 3 ]] && { log "error: apt-get failed three times (a test runs in its own network namespace and reaches nothing outside: run e2e/node-tools.sh, or make test, first)"; exit 1; }
		log "apt-get failed (attempt $attempt of 3); again in 15 s"
		sleep 15
	done
fi
# The packages' own services are never used: every node starts its own containerd.
CNI_DIR=/usr/lib/cni
for b in containerd ctr runc; do command -v "$b" >/dev/null || { log "error: $b missing after install"; exit 1; }; done
for b in bridge host-local loopback; do [[ -x $CNI_DIR/$b ]] || { log "error: CNI plugin $CNI_DIR/$b missing"; exit 1; }; done
echo "CONTAINERD=$(command -v containerd)"
echo "CTR=$(command -v ctr)"
echo "RUNC=$(command -v runc)"
echo "CNI_BIN_DIR=$CNI_DIR"
echo "BUSYBOX=/bin/busybox"
