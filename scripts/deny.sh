#!/usr/bin/env bash
# cargo-deny over the workspace's dependency tree, with the policy in deny.toml: licences,
# bans (no wildcard requirements; duplicate versions are warnings) and sources (crates.io only).
#
# Advisories are NOT checked: `cargo deny check advisories` needs the RustSec advisory database,
# a git repository on GitHub, and GitHub is unreachable from this project's machines (only the
# package registries are). Everything below runs offline.
#
# cargo-deny is pinned (a newer one may change the config format or what it rejects) and
# installed from crates.io when missing or at another version: about 8.5 minutes under `nice`
# on the shared two-core machine.
set -euo pipefail

CARGO_DENY_VERSION=0.20.2

cd "$(dirname "$0")/.."

installed=$(cargo deny --version 2>/dev/null || true)
if [ "$installed" != "cargo-deny $CARGO_DENY_VERSION" ]; then
    echo "deny: installing cargo-deny $CARGO_DENY_VERSION (found: ${installed:-none})" >&2
    nice cargo install --locked cargo-deny --version "$CARGO_DENY_VERSION"
fi

# cargo-deny reads the whole graph offline, every platform's crates included (Windows-only
# ones too), which a build on this machine never downloads: fetch them first (crates.io is
# reachable; a warm cache makes this a no-op).
cargo fetch --locked >/dev/null
echo "deny: advisories not checked: the RustSec advisory database is on GitHub, unreachable from here"
# The inclusion graph of each duplicate-version warning is hidden (hundreds of lines); drop
# --hide-inclusion-graph to see why a crate is in the tree.
exec cargo deny --locked --offline check --hide-inclusion-graph licenses bans sources
