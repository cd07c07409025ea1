#!/usr/bin/env bash
# Prints CHANGELOG.md's section for VERSION (`## [VERSION]` up to the next `## [`), without its
# heading: the GitHub release's notes. Fails when the section is missing or empty, so a release
# never goes out without its notes.
set -euo pipefail
version="${1:?usage: release-notes.sh VERSION}"
changelog="${2:-$(dirname "$0")/../CHANGELOG.md}"
notes=$(awk -v v="$version" '
	/^## \[/ { if (found) exit; if (index($0, "## [" v "]") == 1) { found = 1; next } }
	found { print }
' "$changelog")
if [[ -z "${notes//[[:space:]]/}" ]]; then
	echo "release-notes.sh: CHANGELOG.md has no notes for $version (a '## [$version]' section)" >&2
	exit 1
fi
printf '%s\n' "$notes" | sed -e '/./,$!d'
