#!/usr/bin/env python3
"""Values parity with HAMi v2.10 (issue #16 item 5), run by e2e/chart-test.sh.

Walks every leaf key of HAMi v2.10's values file (e2e/fixtures/hami-v2.10-values.yaml) against
the inventory charts/tessera/files/hami-v2.10-keys.yaml and renders the chart once per key, on top
of HAMi's values file:

  * every leaf key of the fixture has an entry, and every entry is a leaf key of the fixture;
  * an entry is well formed for its disposition, and a `refused` entry's `allowed` values include
    HAMi's default (so HAMi's own values file installs);
  * honoured: the render with the test value succeeds and differs from HAMi's own render (certificate
    material masked) and has a line matching `expect` that HAMi's own render lacks; with
    `unchanged`, it is identical;
  * refused: `helm template` fails and its message names the key;
  * vendor-skipped: a changed value renders identically (nothing half-used).

  e2e/hami-values-test.py HELM CHART FIXTURE KUBE_VERSION
Prints ok:/FAIL: lines and a summary; exit status 1 on any failure. Needs python3 with PyYAML.
"""
import concurrent.futures
import json
import os
import re
import subprocess
import sys

import yaml

RELEASE = "tessera"
NAMESPACE = "tessera-system"
DISPOSITIONS = ("honoured", "refused", "vendor-skipped")
# Generated per render (Helm issues the certificates): masked before comparing.
MASK = re.compile(r"^(\s*(?:tls\.crt|tls\.key|ca\.crt|caBundle|checksum/serving-cert|checksum/extender-client)):.*$", re.M)


def leaves(value, path=()):
    """Leaf keys: paths to scalars, lists, null and empty maps."""
    if isinstance(value, dict) and value:
        for k, v in value.items():
            yield from leaves(v, path + (str(k),))
    else:
        yield ".".join(path), value


def changed(value):
    """A value of the same kind that differs from `value` (for vendor-skipped keys)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, list):
        return value + ["changed.example.com/x"] if value else ["changed"]
    if isinstance(value, dict):
        return {"changed": "x"}
    if value is None:
        return "changed"
    return str(value) + "-changed"


def main():
    if len(sys.argv) != 5:
        print(__doc__, file=sys.stderr)
        return 2
    helm, chart, fixture, kube_version = sys.argv[1:]
    with open(fixture) as f:
        hami = dict(leaves(yaml.safe_load(f)))
    with open(os.path.join(chart, "files", "hami-v2.10-keys.yaml")) as f:
        inventory = yaml.safe_load(f)["keys"]

    failures = []

    def fail(msg):
        failures.append(msg)
        print("FAIL: " + msg, file=sys.stderr)

    def ok(msg):
        print("ok:   " + msg)

    missing = sorted(set(hami) - set(inventory))
    extra = sorted(set(inventory) - set(hami))
    for k in missing:
        fail(f"{k}: a leaf key of HAMi v2.10's values without an entry in files/hami-v2.10-keys.yaml")
    for k in extra:
        fail(f"{k}: in files/hami-v2.10-keys.yaml but not a leaf key of HAMi v2.10's values")
    if not missing and not extra:
        ok(f"files/hami-v2.10-keys.yaml lists exactly the {len(hami)} leaf keys of HAMi v2.10's values")

    def render(sets):
        args = [helm, "template", RELEASE, chart, "--namespace", NAMESPACE, "--kube-version", kube_version, "-f", fixture]
        for k, v in sets:
            args += ["--set-json", f"{k}={json.dumps(v)}"]
        p = subprocess.run(args, capture_output=True, text=True)
        return p.returncode, MASK.sub(r"\1: <masked>", p.stdout), p.stderr

    baselines = {}

    def baseline(with_sets):
        key = json.dumps(with_sets)
        if key not in baselines:
            baselines[key] = render(with_sets)
        return baselines[key]

    def check(key):
        """Returns (ok, message) for one key."""
        entry = inventory[key]
        disposition = entry.get("disposition")
        test = entry.get("test") or {}
        with_sets = sorted((test.get("with") or {}).items())
        if disposition not in DISPOSITIONS:
            return False, f"{key}: disposition {disposition!r} is not one of {', '.join(DISPOSITIONS)}"
        if disposition == "vendor-skipped":
            value = changed(hami[key])
            rc, out, err = render([(key, value)])
            base = baseline([])
            if rc != 0:
                return False, f"{key} (vendor-skipped): {json.dumps(value)} fails to render: {err.strip()}"
            if out != base[1]:
                return False, f"{key} (vendor-skipped): {json.dumps(value)} changes the render; it is used, so list where"
            return True, f"{key}: vendor-skipped, a changed value renders identically"
        if "value" not in test:
            return False, f"{key}: no test value"
        value = test["value"]
        if disposition == "refused":
            if not entry.get("instead"):
                return False, f"{key}: refused without `instead` (what to use)"
            if "allowed" in entry and not any(json.dumps(a, sort_keys=True) == json.dumps(hami[key], sort_keys=True) for a in entry["allowed"]):
                return False, f"{key}: `allowed` lacks HAMi's default {json.dumps(hami[key])}: HAMi's values file would be refused"
            rc, out, err = render(with_sets + [(key, value)])
            if rc == 0:
                return False, f"{key} (refused): {json.dumps(value)} renders; it must fail the install"
            if key not in err:
                return False, f"{key} (refused): the error does not name the key: {err.strip()}"
            return True, f"{key}: {json.dumps(value)} refused: {err.strip().splitlines()[0][:160]}"
        # honoured
        if not entry.get("where"):
            return False, f"{key}: honoured without `where`"
        base_rc, base_out, base_err = baseline(with_sets)
        if base_rc != 0:
            return False, f"{key}: the baseline with {with_sets} fails: {base_err.strip()}"
        rc, out, err = render(with_sets + [(key, value)])
        if rc != 0:
            return False, f"{key} (honoured): {json.dumps(value)} fails to render: {err.strip()}"
        if test.get("unchanged"):
            if out != base_out:
                return False, f"{key} (honoured, unchanged): {json.dumps(value)} changes the render"
            return True, f"{key}: {json.dumps(value)} renders identically, as in HAMi's chart ({entry['where'][:80]})"
        if out == base_out:
            return False, f"{key} (honoured): {json.dumps(value)} renders the same as HAMi's default: ignored"
        pattern = test.get("expect")
        if pattern and not re.search(pattern, out, re.M):
            return False, f"{key} (honoured): {json.dumps(value)} renders no line matching /{pattern}/"
        if pattern and re.search(pattern, base_out, re.M):
            return False, f"{key}: /{pattern}/ matches HAMi's own render too; the test proves nothing"
        return True, f"{key}: {json.dumps(value)} honoured ({entry['where'][:80]})"

    keys = [k for k in inventory if k in hami]
    # The baseline first, so the workers share it.
    base = baseline([])
    if base[0] != 0:
        fail(f"HAMi v2.10's values do not render: {base[2].strip()}")
        return 1
    # Vendor-skipped keys: all changed in one render; one by one only when that one differs.
    vendor = [k for k in keys if inventory[k].get("disposition") == "vendor-skipped"]
    rc, out, err = render([(k, changed(hami[k])) for k in vendor])
    if vendor and rc == 0 and out == base[1]:
        ok(f"{len(vendor)} vendor-skipped keys, all changed at once, render identically")
        keys = [k for k in keys if k not in vendor]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        results = list(pool.map(check, keys))
    for passed, msg in results:
        (ok if passed else fail)(msg)

    counts = {d: sum(1 for k in hami if k in inventory and inventory[k].get("disposition") == d) for d in DISPOSITIONS}
    summary = ", ".join(f"{n} {d}" for d, n in counts.items())
    if failures:
        print(f"hami-values-test: {len(failures)} failure(s); {len(hami)} keys: {summary}", file=sys.stderr)
        return 1
    print(f"hami-values-test: all {len(hami)} leaf keys of HAMi v2.10's values checked: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
