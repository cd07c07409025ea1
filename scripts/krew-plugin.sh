#!/usr/bin/env bash
# Sourced by scripts/release.sh and scripts/krew-check.sh (run from the repository root).

# krew_plugin OUT VERSION EPOCH ARCHES: `kubectl tessera` as krew installs it, from
# OUT/bin/<arch>/kubectl-tessera: an archive per architecture
# (kubectl-tessera and LICENSE, reproducible: sorted, the commit's time, no owner, gzip -n) and
# OUT/krew/tessera.yaml, krew/tessera.yaml with this version and each archive's SHA-256 (an
# architecture not built is left out of the manifest).
krew_plugin() {
	local out="$1" version="$2" epoch="$3" arches="$4" arch stage
	for arch in $arches; do
		stage=$(mktemp -d)
		install -m 0755 "$out/bin/$arch/kubectl-tessera" "$stage/kubectl-tessera"
		install -m 0644 LICENSE "$stage/LICENSE"
		tar --sort=name --mtime="@$epoch" --owner=0 --group=0 --numeric-owner -C "$stage" \
			-cf - kubectl-tessera LICENSE | gzip -n -9 >"$out/kubectl-tessera-v$version-linux-$arch.tar.gz"
		rm -rf "$stage"
	done
	mkdir -p "$out/krew"
	python3 - krew/tessera.yaml "$out" "$version" "$arches" >"$out/krew/tessera.yaml" <<'PY'
import hashlib, sys, yaml
template, out, version, arches = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split()
plugin = yaml.safe_load(open(template).read().replace("@VERSION@", version))
platforms = []
for p in plugin["spec"]["platforms"]:
    arch = p["selector"]["matchLabels"]["arch"]
    if arch not in arches:
        continue
    archive = f"{out}/kubectl-tessera-v{version}-linux-{arch}.tar.gz"
    p["sha256"] = hashlib.sha256(open(archive, "rb").read()).hexdigest()
    platforms.append(p)
plugin["spec"]["platforms"] = platforms
# Multi-line texts stay literal blocks, as written.
yaml.SafeDumper.add_representer(str, lambda d, s: d.represent_scalar(
    "tag:yaml.org,2002:str", s, style="|" if "\n" in s else None))
yaml.safe_dump(plugin, sys.stdout, sort_keys=False, width=1000)
PY
}
