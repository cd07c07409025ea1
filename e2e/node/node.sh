#!/usr/bin/env bash
# One real e2e node: containerd and a kubelet, supervised the way systemd supervises them on a
# real machine. tessera-e2e starts it as
#
#   unshare --mount --uts --pid --fork --kill-child --mount-proc --propagation private node.sh
#
# so the node has its own mount table, hostname and process tree, and shares the test's network
# namespace (its address is on the test's dummy interface). The kubelet's fixed paths
# (/var/lib/kubelet/device-plugins, pod-resources, /var/log/pods) and the hook directory are this
# node's own: bind mounts of directories under NODE_DIR, visible to nothing outside. When the
# test kills `unshare`, the kernel kills every process of the node (containers included) and the
# node's mounts vanish with its mount namespace: nothing is left on the host but NODE_DIR.
#
# Environment (set by tessera-e2e): NODE_NAME, NODE_IP, NODE_DIR, LOG_DIR, KUBELET, CONTAINERD,
# CTR, HOOK_DIR (the chart's <gpuHookPath>/vgpu).
# Signals: USR1 kills the kubelet, USR2 kills containerd; each comes back a second later, as a
# service manager restarts it.
set -uo pipefail

log() { printf '%s node.sh[%s]: %s\n' "$(date +%H:%M:%S.%3N)" "$NODE_NAME" "$*" >&2; }
die() { log "error: $*"; exit 1; }

hostname "$NODE_NAME" || die "hostname"

# The node's private filesystem view.
mount -t tmpfs -o mode=0755 tmpfs /run || die "tmpfs on /run"
bind_own() { # bind_own HOST_PATH: NODE_DIR/fs/HOST_PATH over HOST_PATH
	local src="$NODE_DIR/fs$1"
	mkdir -p "$src" "$1" || die "mkdir $1"
	mount --bind "$src" "$1" || die "bind $src over $1"
}
bind_own /var/lib/kubelet
bind_own /var/lib/cni
bind_own /var/log
# The node gets its own /tmp, but a checkout under /tmp (the run directory, the images and the
# binaries live in it) must stay visible at the same path: keep each such top-level entry.
keep_tmp=()
for p in "$NODE_DIR" "$LOG_DIR" "$KUBELET" "$CONTAINERD" "$CTR"; do
	case "$p" in /tmp/?*) rest=${p#/tmp/}; keep_tmp+=("/tmp/${rest%%/*}") ;; esac
done
if [[ ${#keep_tmp[@]} -gt 0 ]]; then
	mkdir -p /run/host-tmp && mount --bind /tmp /run/host-tmp || die "bind /tmp to /run/host-tmp"
fi
bind_own /tmp
chmod 1777 /tmp
for top in $(printf '%s\n' "${keep_tmp[@]}" | sort -u); do
	mkdir -p "$top" && mount --bind "/run/host-tmp/${top#/tmp/}" "$top" || die "keep $top visible"
done
bind_own "$HOOK_DIR"
# Shared, as a systemd host's mounts are: the device plugin mounts each container's size-limited
# cache directory there (mountPropagation: Bidirectional), and the kubelet must see it.
mount --make-rshared "$HOOK_DIR" || die "make $HOOK_DIR shared"
# The NVIDIA container toolkit's configuration: the fake runtime and the device plugin read it.
bind_own /etc/nvidia-container-runtime

CONTAINERD_PID=0
KUBELET_PID=0

start_containerd() {
	"$CONTAINERD" --config "$NODE_DIR/containerd.toml" >>"$LOG_DIR/$NODE_NAME-containerd.log" 2>&1 &
	CONTAINERD_PID=$!
	local i
	for i in $(seq 1 200); do
		[[ -S /run/containerd/containerd.sock ]] && "$CTR" -a /run/containerd/containerd.sock version >/dev/null 2>&1 && return 0
		kill -0 "$CONTAINERD_PID" 2>/dev/null || die "containerd exited (see $NODE_NAME-containerd.log)"
		sleep 0.05
	done
	die "containerd did not serve its socket within 10 s"
}

start_kubelet() {
	"$KUBELET" --config="$NODE_DIR/kubelet.yaml" --kubeconfig="$NODE_DIR/kubeconfig" \
		--hostname-override="$NODE_NAME" --node-ip="$NODE_IP" --root-dir=/var/lib/kubelet \
		--node-labels="$NODE_LABELS" --v=2 >>"$LOG_DIR/$NODE_NAME-kubelet.log" 2>&1 &
	KUBELET_PID=$!
}

start_containerd
log "containerd up; importing images"
while read -r tar; do
	[[ -n $tar ]] || continue
	"$CTR" -a /run/containerd/containerd.sock -n k8s.io images import "$tar" >/dev/null \
		|| die "importing $tar"
done <"$NODE_DIR/images.list"
log "images imported; starting the kubelet"
start_kubelet
echo ready >"$NODE_DIR/ready"

trap 'log "USR1: killing the kubelet"; kill -KILL "$KUBELET_PID" 2>/dev/null' USR1
trap 'log "USR2: killing containerd"; kill -KILL "$CONTAINERD_PID" 2>/dev/null' USR2
trap 'log "TERM: stopping"; kill -TERM "$KUBELET_PID" "$CONTAINERD_PID" 2>/dev/null; exit 0' TERM

while true; do
	wait -n 2>/dev/null || sleep 0.2
	if ! kill -0 "$CONTAINERD_PID" 2>/dev/null; then
		log "containerd exited; restarting in 1 s"
		sleep 1
		start_containerd
	fi
	if ! kill -0 "$KUBELET_PID" 2>/dev/null; then
		log "kubelet exited; restarting in 1 s"
		sleep 1
		start_kubelet
	fi
done
