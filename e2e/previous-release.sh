#!/usr/bin/env bash
# The version an upgrade starts from (e2e/tests/real_faults.rs): the device plugin, the DRA
# plugin, the scheduler extender and the shim of PREVIOUS_REV, built from this repository's
# history, and that commit's chart. No Tessera release has been published yet, so PREVIOUS_REV is the last
# commit whose CI passed before the upgrade test was written; at each release it moves to the
# release before (docs/release.md). Built once into ~/.cache/tessera/previous/<rev> (keyed by the
# commit; about 4 minutes on 2 cores), then only printed:
#   PREVIOUS_REV, PREVIOUS_DIR (bin/: the daemons and the shim; chart/: the chart's source).
set -euo pipefail
PREVIOUS_REV="${PREVIOUS_REV:-e4ccb4d656d3de68815afea8ed02ceb9c96156f7}"
root="$(cd "$(dirname "$0")/.." && pwd)"
cache="${TESSERA_CACHE:-$HOME/.cache/tessera}/previous/$PREVIOUS_REV"
log() { echo "previous-release: $*" >&2; }

if [[ ! -f "$cache/done" ]]; then
	if ! git -C "$root" cat-file -e "$PREVIOUS_REV^{commit}" 2>/dev/null; then
		log "commit $PREVIOUS_REV is not in this clone's history (a shallow clone?): fetch it, or set PREVIOUS_REV"
		exit 1
	fi
	log "building the device plugin, scheduler and shim of $PREVIOUS_REV (one-time cost, about 4 minutes on 2 cores)"
	rm -rf "$cache"
	mkdir -p "$cache/src" "$cache/bin"
	git -C "$root" archive "$PREVIOUS_REV" | tar -x -C "$cache/src"
	# Its own target directory (another source path would only churn CI's), removed once the
	# binaries are copied out: the disk is shared. No debug info: smaller images, faster links.
	(
		cd "$cache/src"
		CARGO_TARGET_DIR="$cache/target" CARGO_INCREMENTAL=0 CARGO_PROFILE_DEV_DEBUG=0 \
			nice -n 19 cargo build --locked -p tessera-device-plugin -p tessera-dra-plugin -p tessera-scheduler -p libvgpu-shim >&2
	)
	for b in tessera-device-plugin tessera-dra-plugin tessera-scheduler libvgpu.so; do
		cp "$cache/target/debug/$b" "$cache/bin/$b"
	done
	mkdir -p "$cache/chart"
	cp -r "$cache/src/charts/tessera" "$cache/chart/"
	rm -rf "$cache/target" "$cache/src"
	touch "$cache/done"
fi

echo "PREVIOUS_REV=$PREVIOUS_REV"
echo "PREVIOUS_DIR=$cache"
