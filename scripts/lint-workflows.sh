#!/usr/bin/env bash
# Lints .github/workflows/ with actionlint (built from its Go module by e2e/tools.sh), the `run:`
# scripts with shellcheck (Debian's, installed once), and checks the release tooling's own
# scripts: shellcheck, and release-notes.sh on a sample changelog.
set -euo pipefail
cd "$(dirname "$0")/.."
actionlint=$(./e2e/tools.sh | sed -n 's/^ACTIONLINT=//p')
if ! command -v shellcheck >/dev/null 2>&1; then
	[[ $(id -u) == 0 ]] || { echo "lint-workflows.sh: shellcheck is missing (apt-get install shellcheck)" >&2; exit 1; }
	echo "lint-workflows.sh: installing shellcheck (once)" >&2
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends shellcheck >&2 ||
		{ apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends shellcheck >&2; }
fi
"$actionlint" -color -shellcheck="$(command -v shellcheck)" -pyflakes=
shellcheck scripts/release.sh scripts/release-notes.sh scripts/lint-workflows.sh docker/cross-env.sh e2e/previous-release.sh scripts/krew-plugin.sh scripts/krew-check.sh

# release-notes.sh: the section of the version asked for, nothing of the next; a missing one
# fails.
sample=$(mktemp)
trap 'rm -f "$sample"' EXIT
printf '# Changelog\n\n## [Unreleased]\n\n- next\n\n## [1.2.0] - 2026-12-01\n\n### Added\n\n- a thing\n\n## [1.1.0]\n\n- older\n' >"$sample"
got=$(./scripts/release-notes.sh 1.2.0 "$sample")
want=$(printf '### Added\n\n- a thing')
[[ "$got" == "$want" ]] || { printf 'release-notes.sh 1.2.0 printed:\n%s\n' "$got" >&2; exit 1; }
if ./scripts/release-notes.sh 9.9.9 "$sample" 2>/dev/null; then
	echo "release-notes.sh: a version without notes did not fail" >&2
	exit 1
fi
echo "lint-workflows.sh: workflows and release scripts clean" >&2
