#!/usr/bin/env bash
# The krew manifest as a user installs from it: scripts/krew-plugin.sh (what `make release` runs)
# makes the archive and the manifest from this build's kubectl-tessera, and krew (built from its
# Go module by e2e/tools.sh) installs the plugin with `krew install --manifest --archive` into a
# scratch KREW_ROOT; the installed `kubectl-tessera --version` must answer. Run by `make chart`.
set -euo pipefail
cd "$(dirname "$0")/.."
krew=$(./e2e/tools.sh | sed -n 's/^KREW=//p')
cargo build --locked -p kubectl-tessera >&2
binary="${CARGO_TARGET_DIR:-target}/debug/kubectl-tessera"
version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"/\1/p' Cargo.toml)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/out/bin/amd64"
cp "$binary" "$work/out/bin/amd64/kubectl-tessera"
# shellcheck source=scripts/krew-plugin.sh
. scripts/krew-plugin.sh
krew_plugin "$work/out" "$version" "$(git show -s --format=%ct HEAD)" amd64
KREW_ROOT="$work/krew" "$krew" install --manifest="$work/out/krew/tessera.yaml" \
	--archive="$work/out/kubectl-tessera-v$version-linux-amd64.tar.gz" >"$work/install.log" 2>&1 \
	|| { cat "$work/install.log" >&2; echo "krew-check: krew refused the manifest" >&2; exit 1; }
installed="$("$work/krew/bin/kubectl-tessera" --version)"
[[ "$installed" == "kubectl-tessera $version "* ]] || { echo "krew-check: installed plugin says: $installed" >&2; exit 1; }
echo "krew-check: krew installed kubectl tessera $version from the release's manifest and archive"
