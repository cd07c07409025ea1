#!/usr/bin/env bash
# Chart CI for charts/tessera, offline:
#   1. builds (or reuses) the pinned helm, kubeconform and Kubernetes JSON schemas (e2e/tools.sh);
#   2. proves the validator rejects known-bad manifests (so a permissive schema cannot pass silently);
#   3. `helm lint --strict` and `helm template` with the default values and every ci/*-values.yaml;
#   4. validates every rendered object with `kubeconform -strict` against the Kubernetes schemas
#      of the pinned release (unknown fields, wrong types and missing required fields all fail);
#      only the CRD kinds (cert-manager Certificate/Issuer, ServiceMonitor) have no schema here and
#      are checked by the assertions below instead;
#   5. decodes every rendered KubeSchedulerConfiguration strictly with kube-scheduler's v1 types,
#      and evaluates the webhook's CEL matchConditions with the API server's matcher on sample
#      pods (chartcheck, built by e2e/tools.sh);
#   6. asserts what the chart must render (fail-closed webhook, extender config, security), and
#      that charts/tessera/files/kube-scheduler-config.yaml is exactly what the chart renders;
#   7. renders HAMi v2.10's own default values file, unchanged (e2e/fixtures/hami-v2.10-values.yaml),
#      through all of the above, and checks its images, kube-scheduler arguments and NodePorts; then
#      e2e/hami-values-test.py walks every leaf key of that file against
#      charts/tessera/files/hami-v2.10-keys.yaml (honoured: the render changes; refused: the install
#      fails naming the key; other vendors' keys: unused), one render per key;
#   8. runs the built daemons on every argument list the chart renders for them (each value set).
#
#   e2e/chart-test.sh            # run everything; non-zero exit on any failure
#   e2e/chart-test.sh --update   # rewrite files/kube-scheduler-config.yaml from the chart
#
# Needs: bash, go (first run only), python3 with PyYAML, grep, sed, awk, paste, diff; openssl optional. No network except the Go module proxy on
# the first run.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CHART="${TESSERA_CHART_DIR:-$ROOT/charts/tessera}"
RELEASE=tessera
NAMESPACE=tessera-system
SCHED_CONFIG_FILE="$CHART/files/kube-scheduler-config.yaml"

UPDATE=false
case "${1:-}" in
	--update) UPDATE=true ;;
	"") ;;
	*) echo "usage: $0 [--update]" >&2; exit 2 ;;
esac

eval "$("$ROOT/e2e/tools.sh")"
# The values checks read YAML with PyYAML; a fresh Debian machine gets it from its packages.
if ! python3 -c 'import yaml' 2>/dev/null; then
	echo "chart-test: installing python3-yaml (PyYAML) from Debian's packages" >&2
	apt-get install -y -q python3-yaml >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q python3-yaml >/dev/null; }
fi
# kubeconform reads {{ .ResourceKind }}{{ .KindSuffix }}.json; the strict tree forbids unknown fields.
SCHEMA_LOCATION="$K8S_SCHEMA_DIR/strict/{{ .ResourceKind }}{{ .KindSuffix }}.json"
# Custom resources without a schema in the Kubernetes release; asserted below.
CRD_KINDS="monitoring.coreos.com/v1/ServiceMonitor,monitoring.coreos.com/v1/PrometheusRule,cert-manager.io/v1/Certificate,cert-manager.io/v1/Issuer"

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
FAILURES=0
fail() { printf 'FAIL: %s\n' "$*" >&2; FAILURES=$((FAILURES + 1)); }
pass() { printf 'ok:   %s\n' "$*"; }
# A check this machine cannot run: said, or a failure under TESSERA_NO_SKIP=1 (CI).
skip() { if [[ "${TESSERA_NO_SKIP:-}" == 1 ]]; then fail "$* (TESSERA_NO_SKIP=1: a skip is a failure)"; else printf 'skip: %s\n' "$*"; fi; }

render() { # render OUT [helm template args...]
	local out="$1"; shift
	"$HELM" template "$RELEASE" "$CHART" --namespace "$NAMESPACE" --kube-version "$K8S_SCHEMA_VERSION" "$@" >"$out"
}

kubeconform_check() { # kubeconform_check FILE
	"$KUBECONFORM" -strict -summary -output text -kubernetes-version "$K8S_SCHEMA_VERSION" \
		-schema-location "$SCHEMA_LOCATION" -skip "$CRD_KINDS" "$1"
}

# The YAML block under `config.yaml: |` in the scheduler ConfigMap, de-indented.
extract_scheduler_config() { # extract_scheduler_config RENDERED_CONFIGMAP
	awk '/^  config.yaml: \|/ {on=1; next} on && /^    / {print substr($0, 5); next} on && /^$/ {print ""; next} on {exit}' "$1"
}

expect() { # expect DESCRIPTION FILE PATTERN  (grep -E, must match)
	if grep -Eq -- "$3" "$2"; then pass "$1"; else fail "$1 (no line matching /$3/ in $(basename "$2"))"; fi
}
expect_not() { # expect_not DESCRIPTION FILE PATTERN  (must not match)
	if grep -Eq -- "$3" "$2"; then fail "$1 (unexpected line matching /$3/ in $(basename "$2"))"; else pass "$1"; fi
}
expect_count() { # expect_count DESCRIPTION FILE PATTERN N
	local n
	n="$(grep -Ec -- "$3" "$2" || true)"
	if [[ "$n" == "$4" ]]; then pass "$1"; else fail "$1 (expected $4 lines matching /$3/, found $n)"; fi
}

echo "== helm $("$HELM" version --short 2>/dev/null || echo '?'), kubeconform $("$KUBECONFORM" -v 2>/dev/null || echo '?'), Kubernetes schemas $K8S_SCHEMA_VERSION"

if report="$("$CHARTCHECK" scheduler-config "$SCHED_CONFIG_FILE" 2>&1)"; then
	pass "files/kube-scheduler-config.yaml decodes strictly with kube-scheduler's v1 types"
else
	printf '%s\n' "$report" >&2
	fail "files/kube-scheduler-config.yaml is not a valid KubeSchedulerConfiguration"
fi

# --- 1. The validator itself must reject what the API server would reject -----------------------
cat >"$WORK/negative.yaml" <<'EOF'
apiVersion: apps/v1
kind: Deployment
metadata: {name: wrong-type}
spec:
  replicas: "three"
  selector: {matchLabels: {a: b}}
  template:
    metadata: {labels: {a: b}}
    spec: {containers: [{name: c, image: x}]}
---
apiVersion: apps/v1
kind: DaemonSet
metadata: {name: unknown-field}
spec:
  selector: {matchLabels: {a: b}}
  template:
    metadata: {labels: {a: b}}
    spec: {containers: [{name: c, image: x, imagePullPolicyy: Always}]}
---
apiVersion: v1
kind: Pod
metadata: {name: missing-required}
spec: {containers: [{image: x}]}
---
apiVersion: admissionregistration.k8s.io/v1
kind: MutatingWebhookConfiguration
metadata: {name: no-review-versions}
webhooks:
  - name: a.example.com
    clientConfig: {service: {name: s, namespace: ns}}
    sideEffects: None
---
apiVersion: policy/v1beta1
kind: PodDisruptionBudget
metadata: {name: removed-api}
spec: {maxUnavailable: 1}
EOF
negatives=5
invalid="$(kubeconform_check "$WORK/negative.yaml" 2>&1 | grep -Ec ' is invalid: | failed validation: ' || true)"
if [[ "$invalid" == "$negatives" ]]; then
	pass "validator rejects all $negatives known-bad manifests"
else
	kubeconform_check "$WORK/negative.yaml" >&2 || true
	fail "validator rejected $invalid of $negatives known-bad manifests"
fi
cat >"$WORK/positive.yaml" <<'EOF'
apiVersion: v1
kind: Pod
metadata: {name: fine}
spec:
  containers:
    - name: c
      image: x
      resources: {limits: {cpu: 1, memory: 1Gi, nvidia.com/gpu: 1}}
      livenessProbe: {httpGet: {port: http, path: /}}
EOF
if kubeconform_check "$WORK/positive.yaml" >/dev/null; then pass "validator accepts a valid Pod (quantities, int-or-string ports)"; else fail "validator rejects a valid Pod"; fi

# --- 2. lint, render and validate every values set -----------------------------------------------
# HAMi v2.10's default values file, unchanged: a HAMi user's install must render and validate.
HAMI_VALUES="$ROOT/e2e/fixtures/hami-v2.10-values.yaml"
value_sets=(default)
for f in "$CHART"/ci/*-values.yaml; do value_sets+=("$(basename "$f" -values.yaml)"); done
value_sets+=(hami-v2.10)
values_file() { # values_file SET: the values file of a set ("" for the defaults)
	case "$1" in
		default) ;;
		hami-v2.10) printf '%s' "$HAMI_VALUES" ;;
		*) printf '%s' "$CHART/ci/$1-values.yaml" ;;
	esac
}

for set in "${value_sets[@]}"; do
	args=()
	[[ "$set" == default ]] || args=(--values "$(values_file "$set")")
	out="$WORK/$set.yaml"
	if "$HELM" lint --strict --kube-version "$K8S_SCHEMA_VERSION" "$CHART" "${args[@]}" >"$WORK/$set.lint" 2>&1; then
		pass "[$set] helm lint --strict"
	else
		cat "$WORK/$set.lint" >&2
		fail "[$set] helm lint --strict"
	fi
	if ! render "$out" "${args[@]}" 2>"$WORK/$set.err"; then
		cat "$WORK/$set.err" >&2
		fail "[$set] helm template"
		continue
	fi
	pass "[$set] helm template ($(grep -c '^kind:' "$out") objects)"
	if report="$(kubeconform_check "$out" 2>&1)"; then
		pass "[$set] kubeconform -strict: ${report##*$'\n'}"
	else
		printf '%s\n' "$report" >&2
		fail "[$set] kubeconform -strict"
	fi
	# Only the CRD kinds may be skipped; anything else without a schema is an error above.
	builtin="$(grep -E '^kind: ' "$out" | grep -Evc '^kind: (ServiceMonitor|PrometheusRule|Certificate|Issuer)$' || true)"
	[[ "$builtin" -gt 0 ]] || fail "[$set] rendered no built-in objects"

	# kube-scheduler's own types decode the scheduler config strictly.
	extract_scheduler_config "$out" >"$WORK/$set.kube-scheduler.yaml"
	if [[ -s "$WORK/$set.kube-scheduler.yaml" ]]; then
		if report="$("$CHARTCHECK" scheduler-config "$WORK/$set.kube-scheduler.yaml" 2>&1)"; then
			pass "[$set] KubeSchedulerConfiguration decodes strictly with kube-scheduler's v1 types"
		else
			printf '%s\n' "$report" >&2
			fail "[$set] KubeSchedulerConfiguration"
		fi
	fi

	# The API server's own matcher evaluates the webhook's CEL matchConditions on sample pods.
	if grep -q '^kind: MutatingWebhookConfiguration$' "$out"; then
		resources="$(sed -nE 's/^      resource(Count|Memory|MemoryPercentage|Core|Priority)Name: "(.*)"$/\2/p' "$out" | paste -sd, -)"
		trusted="$(sed -nE 's/^            - --webhook-trusted-user=(.*)$/\1/p' "$out" | paste -sd, -)"
		gpu_only=false
		grep -q 'name: gpu-pod-or-hami-metadata' "$out" && gpu_only=true
		if report="$("$CHARTCHECK" webhook-match -resources "$resources" -trusted "$trusted" -gpu-only="$gpu_only" "$out" 2>&1)"; then
			pass "[$set] webhook matchConditions: $(grep -c '^ok ' <<<"$report") sample requests give the expected answer, no evaluation error"
		else
			printf '%s\n' "$report" >&2
			fail "[$set] webhook matchConditions"
		fi
	fi
done

# --- 3. What the chart must render -----------------------------------------------------------------
D="$WORK/default.yaml"
render "$WORK/default-webhook.yaml" --show-only templates/webhook/mutatingwebhook.yaml
W="$WORK/default-webhook.yaml"
expect "webhook fails closed" "$W" '^    failurePolicy: Fail$'
expect "webhook speaks admission.k8s.io/v1 only" "$W" '^    admissionReviewVersions: \[v1\]$'
expect "webhook sees CREATE of pods only (HAMi's; updates are the booking policy's)" "$W" 'operations: \[CREATE\]$'
expect "webhook calls the scheduler Service on /webhook" "$W" '^        path: /webhook$'
expect "webhook skips hami.io/webhook=ignore" "$W" '^        - key: hami.io/webhook$'
expect "webhook never matches the release namespace" "$W" "^            - $NAMESPACE\$"
expect "webhook matches GPU pods only (CEL)" "$W" "k in \\['nvidia.com/gpu', 'nvidia.com/gpumem', 'nvidia.com/gpumem-percentage', 'nvidia.com/gpucores', 'nvidia.com/priority'\\]"
expect "webhook skips Tessera's own service accounts" "$W" "system:serviceaccount:$NAMESPACE:$RELEASE-scheduler', 'system:serviceaccount:$NAMESPACE:$RELEASE-device-plugin'"

render "$WORK/sched-cm.yaml" --show-only templates/scheduler/configmap.yaml
extract_scheduler_config "$WORK/sched-cm.yaml" >"$WORK/kube-scheduler-config.yaml"
S="$WORK/kube-scheduler-config.yaml"
expect "kube-scheduler config kind" "$S" '^kind: KubeSchedulerConfiguration$'
expect "kube-scheduler config apiVersion v1" "$S" '^apiVersion: kubescheduler.config.k8s.io/v1$'
expect "kube-scheduler leader election on" "$S" '^  leaderElect: true$'
expect "profile named hami-scheduler" "$S" '^  - schedulerName: hami-scheduler$'
expect "extender over HTTPS on loopback 443" "$S" '^  - urlPrefix: "https://127.0.0.1:443"$'
expect "extender client certificate (mTLS)" "$S" '^      certFile: /extender-client/tls.crt$'
expect "filterVerb filter" "$S" '^    filterVerb: filter$'
expect "bindVerb bind" "$S" '^    bindVerb: bind$'
expect "nodeCacheCapable" "$S" '^    nodeCacheCapable: true$'
expect "httpTimeout 30s" "$S" '^    httpTimeout: 30s$'
expect_count "all 5 managed resources ignoredByScheduler" "$S" '^        ignoredByScheduler: true$' 5
expect "preemptVerb preempt (GPU-aware preemption)" "$S" '^    preemptVerb: preempt$'
expect_not "no prioritize verb" "$S" 'prioritizeVerb'
render "$WORK/sched-rbac.yaml" --show-only templates/scheduler/rbac.yaml
expect "PodDisruptionBudgets listable for preemption" "$WORK/sched-rbac.yaml" 'resources: \[poddisruptionbudgets\]'
render "$WORK/sched-cm-nopreempt.yaml" --show-only templates/scheduler/configmap.yaml --set scheduler.preemption.enabled=false
expect_not "preemption off: no preemptVerb" "$WORK/sched-cm-nopreempt.yaml" 'preemptVerb'
render "$WORK/sched-rbac-nopreempt.yaml" --show-only templates/scheduler/rbac.yaml --set scheduler.preemption.enabled=false
expect_not "preemption off: no PodDisruptionBudget access" "$WORK/sched-rbac-nopreempt.yaml" 'poddisruptionbudgets'

# The v1.34 preemption opt-in: kube-scheduler counts nvidia.com/gpu, and only it.
render "$WORK/sched-cm-slots.yaml" --show-only templates/scheduler/configmap.yaml --set scheduler.preemption.countSlots=true
extract_scheduler_config "$WORK/sched-cm-slots.yaml" >"$WORK/kube-scheduler-config-count-slots.yaml"
S_SLOTS="$WORK/kube-scheduler-config-count-slots.yaml"
expect_count "countSlots: nvidia.com/gpu counted by kube-scheduler" "$S_SLOTS" '^        ignoredByScheduler: false$' 1
expect_count "countSlots: the other 4 still ignored" "$S_SLOTS" '^        ignoredByScheduler: true$' 4
# (NOTES.txt, which warns on kube-scheduler < 1.38 without countSlots, is rendered only by
# `helm install`; `helm lint` above checks that it renders.)

# Each generated file is exactly what the chart renders (the harness clusters run it; the
# real-node clusters run the chart itself).
for pair in "$SCHED_CONFIG_FILE:$S:default values"; do
	file="${pair%%:*}"; rest="${pair#*:}"; rendered="${rest%%:*}"; values="${rest#*:}"
	if $UPDATE; then
		{
			echo "# Generated by e2e/chart-test.sh --update from charts/tessera ($values,"
			echo "# release $RELEASE, namespace $NAMESPACE). Do not edit: chart-test fails when it drifts."
			cat "$rendered"
		} >"$file"
		pass "rewrote ${file#"$ROOT"/}"
	fi
	if diff -u <(grep -v '^#' "$file") "$rendered" >"$WORK/sched.diff"; then
		pass "files/$(basename "$file") is what the chart renders"
	else
		cat "$WORK/sched.diff" >&2
		fail "files/$(basename "$file") is stale (run e2e/chart-test.sh --update)"
	fi
done

expect "device plugin container name" "$D" '^        - name: tessera-device-plugin$'
expect "device plugin node selector gpu=on" "$D" '^        gpu: "on"$'
expect "device plugin NODE_NAME from the downward API" "$D" '^                  fieldPath: spec.nodeName$'
expect "device plugin metrics on 9394" "$D" '^            - --metrics-addr=0.0.0.0:9394$'
expect "device plugin hook path" "$D" '^            - --hook-path=/usr/local$'
expect "shim init container" "$D" '^        - name: install-vgpu-hook$'
expect "ld.so.preload names the in-container shim" "$D" 'echo /usr/local/vgpu/libvgpu.so > "\$dir/.ld.so.preload.new"'
expect "kubelet device-plugins host path" "$D" '^            path: /var/lib/kubelet/device-plugins$'
expect "kubelet pod-resources host path" "$D" '^            path: /var/lib/kubelet/pod-resources$'
expect "hook host path" "$D" '^            path: /usr/local/vgpu$'
expect "scheduler sidecar" "$D" '^        - name: kube-scheduler$'
expect "extender container" "$D" '^        - name: tessera-scheduler$'
expect "extender HTTPS on 443" "$D" '^            - --http-bind=0.0.0.0:443$'
expect "extender verifies kube-scheduler's client certificate" "$D" '^            - --client-ca-file=/extender-client/ca.crt$'
expect "extender metrics on 9395" "$D" '^            - --metrics-bind-address=0.0.0.0:9395$'
expect_count "every metrics listener behind the API server's authorization" "$D" '^            - --metrics-authorization=kubernetes$' 2
expect "the daemons may review a scrape's token" "$D" '^  name: system:auth-delegator$'
expect_count "text logs by default" "$D" '^            - --log-format=text$' 2
expect_not "no probe reads /metrics (it needs a token)" "$D" '^              path: /metrics$'
expect "extender has its own Lease" "$D" "^            - --leader-elect-resource-name=$RELEASE-scheduler-extender\$"
expect "device-config.yaml nvidia section" "$D" '^    nvidia:$'
expect "device-config deviceSplitCount 10" "$D" '^      deviceSplitCount: 10$'
expect "PodDisruptionBudget" "$D" '^kind: PodDisruptionBudget$'
expect "Helm issues the serving certificate Secret" "$D" "^  name: $RELEASE-scheduler-tls\$"
expect "the webhook carries its caBundle" "$D" '^      caBundle: [A-Za-z0-9+/=]{100,}$'
expect "scheduler pods roll when the serving certificate changes" "$D" '^        checksum/serving-cert: [0-9a-f]{64}$'
expect "the extender reads tls.crt/tls.key of the chart's Secret" "$D" "^            secretName: $RELEASE-scheduler-tls\$"
expect_not "no certificate Jobs (no third-party image)" "$D" '^kind: Job$|kube-webhook-certgen'
# The FlowSchemas match every request of the scheduler pod's accounts on purpose and grant
# nothing; the wildcard check reads every other object (RBAC, and the webhook's rules too).
awk 'function out() { if (doc !~ /\nkind: FlowSchema\n/) printf "%s", doc }
	/^---$/ { out(); doc = "" } { doc = doc $0 "\n" } END { out() }' "$D" >"$WORK/default-no-flowschemas.yaml"
expect_count "the wildcard check reads every object but the 2 FlowSchemas" "$WORK/default-no-flowschemas.yaml" '^kind: ' "$(($(grep -c '^kind: ' "$D") - 2))"
expect_not "no wildcard RBAC" "$WORK/default-no-flowschemas.yaml" "verbs: \\[.*\\*|resources: \\[.*\\*|apiGroups: \\[.*\\*"
expect_not "no cluster-admin" "$D" 'name: cluster-admin'
# The extender's Role names its Lease and (read only) kube-scheduler's; kube-scheduler's Role its own.
expect_count "lease access limited to the two Leases" "$D" "^      - $RELEASE-(scheduler-extender|kube-scheduler)\$" 3
expect_count "two FlowSchemas for the scheduler pod" "$D" '^kind: FlowSchema$' 2
expect "its requests at workload-high, not workload-low" "$D" '^    name: workload-high$'
expect "its Leases at leader-election" "$D" '^    name: leader-election$'

# Admission policies (templates/admission/): enforced by the API server, no label selector.
expect_count "four ValidatingAdmissionPolicies" "$D" '^kind: ValidatingAdmissionPolicy$' 4
expect_count "each bound with Deny" "$D" '^  validationActions: \[Deny\]$' 4
expect_count "policies fail closed" "$D" '^  failurePolicy: Fail$' 4
expect "container isolation covers pods and ephemeral containers" "$D" '^        resources: \[pods, pods/ephemeralcontainers\]$'
expect "container isolation refuses NVIDIA_VISIBLE_DEVICES from unprivileged containers" "$D" "e.name == 'NVIDIA_VISIBLE_DEVICES'"
expect "container isolation guards the shim's paths" "$D" "m\.mountPath\.matches\(r'.*usr.*local.*vgpu.*etc.*ld\\\\\.so\\\\\.preload"
# Size-limited cache directories (issue 28, item 5): the limit's flags, and the propagation that
# lets the plugin's tmpfs mounts reach the kubelet; none for an unprivileged plugin.
render "$WORK/plugin-ds.yaml" --show-only templates/device-plugin/daemonset.yaml
expect "cache directories limited to 16 MiB by default" "$WORK/plugin-ds.yaml" '^            - --cache-dir-limit-mib=16$'
expect "the plugin's host directory propagates its mounts" "$WORK/plugin-ds.yaml" '^              mountPropagation: Bidirectional$'
render "$WORK/metrics-open.yaml" --set metricsAuthorization=none --set serviceMonitor.enabled=true --set dra.enabled=true
expect_count "metricsAuthorization=none: every metrics listener open" "$WORK/metrics-open.yaml" '^            - --metrics-authorization=none$' 3
expect_not "metricsAuthorization=none: no token review rights, no scrape token" "$WORK/metrics-open.yaml" 'system:auth-delegator|bearerTokenFile'
render "$WORK/metrics-sm.yaml" --set serviceMonitor.enabled=true --show-only templates/monitoring/servicemonitor.yaml
expect_count "the ServiceMonitors send Prometheus' token" "$WORK/metrics-sm.yaml" '^      bearerTokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token$' 2
expect_count "the ServiceMonitors keep the series' namespace, pod and container labels" "$WORK/metrics-sm.yaml" '^      honorLabels: true$' 2
# The PrometheusRule: promtool checks its rules and runs their unit tests
# (charts/tessera/tests/prometheusrule-test.yaml) on the rules as the chart renders them.
render "$WORK/prometheusrule.yaml" --set prometheusRule.enabled=true --show-only templates/monitoring/prometheusrule.yaml
mkdir -p "$WORK/promrules"
python3 - "$WORK/prometheusrule.yaml" "$WORK/promrules/tessera-rules.yaml" <<'PY'
import sys, yaml
doc = yaml.safe_load(open(sys.argv[1]))
with open(sys.argv[2], "w") as out:
    yaml.safe_dump({"groups": doc["spec"]["groups"]}, out, sort_keys=False)
PY
cp "$ROOT/charts/tessera/tests/prometheusrule-test.yaml" "$WORK/promrules/"
if report="$("$PROMTOOL" check rules "$WORK/promrules/tessera-rules.yaml" 2>&1)" \
	&& report="$report"$'\n'"$(cd "$WORK/promrules" && "$PROMTOOL" test rules prometheusrule-test.yaml 2>&1)"; then
	pass "PrometheusRule: promtool check rules and $(grep -c 'alertname:' "$ROOT/charts/tessera/tests/prometheusrule-test.yaml") alert checks of its unit tests pass"
else
	printf '%s\n' "$report" >&2
	fail "PrometheusRule: promtool"
fi
render "$WORK/json-logs.yaml" --set logFormat=json --set dra.enabled=true
expect_count "logFormat=json reaches every daemon" "$WORK/json-logs.yaml" '^            - --log-format=json$' 3
if render "$WORK/logs-bad.yaml" --set logFormat=yaml 2>"$WORK/logs-bad.err"; then
	fail "logFormat=yaml should be refused"
else
	expect "logFormat=yaml refused with the accepted values" "$WORK/logs-bad.err" 'must be `text` or `json`'
fi
if render "$WORK/metrics-bad.yaml" --set metricsAuthorization=open 2>"$WORK/metrics-bad.err"; then
	fail "metricsAuthorization=open should be refused"
else
	expect "metricsAuthorization=open refused with the accepted values" "$WORK/metrics-bad.err" 'must be `kubernetes` or `none`'
fi
render "$WORK/plugin-ds-unpriv.yaml" --show-only templates/device-plugin/daemonset.yaml --set devicePlugin.securityContext.privileged=false
expect_not "no Bidirectional propagation for an unprivileged plugin" "$WORK/plugin-ds-unpriv.yaml" 'mountPropagation: Bidirectional'
render "$WORK/plugin-ds-nolimit.yaml" --show-only templates/device-plugin/daemonset.yaml --set devicePlugin.cacheDirLimit.sizeMiB=0
expect_not "cacheDirLimit.sizeMiB=0: no limit, no propagation" "$WORK/plugin-ds-nolimit.yaml" 'cache-dir-limit-mib|mountPropagation: Bidirectional'

# Two identities in the scheduler pod (issue 28, item 5): the extender's token (the pod's account)
# and kube-scheduler's own (its token Secret), each mounted into its own container only.
render "$WORK/sched-identities.yaml" --show-only templates/scheduler/deployment.yaml --show-only templates/scheduler/rbac.yaml
if report="$(python3 - "$WORK/sched-identities.yaml" "$RELEASE" <<'PY' 2>&1
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
release = sys.argv[2]
extender, kube = f"{release}-scheduler", f"{release}-kube-scheduler"
pod = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
assert pod["serviceAccountName"] == extender, pod["serviceAccountName"]
assert pod.get("automountServiceAccountToken") is False, "the pod mounts a token for every container"
volumes = {v["name"]: v for v in pod["volumes"]}
assert volumes["kube-scheduler-token"]["secret"]["secretName"] == f"{kube}-token"
assert any("serviceAccountToken" in s for s in volumes["extender-token"]["projected"]["sources"])
want = {"kube-scheduler": ["kube-scheduler-token"], "tessera-scheduler": ["extender-token"]}
for c in pod["containers"]:
    tokens = [m["name"] for m in c.get("volumeMounts", []) if m["mountPath"].startswith("/var/run/secrets/kubernetes.io")]
    assert tokens == want[c["name"]], (c["name"], tokens)
secret = next(d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == f"{kube}-token")
assert secret["type"] == "kubernetes.io/service-account-token"
assert secret["metadata"]["annotations"]["kubernetes.io/service-account.name"] == kube
for b in (d for d in docs if d["kind"] in ("ClusterRoleBinding", "RoleBinding")):
    subjects = {s["name"] for s in b["subjects"]}
    if b["roleRef"]["name"] in ("system:kube-scheduler", "system:volume-scheduler", "extension-apiserver-authentication-reader"):
        assert subjects == {kube}, (b["metadata"]["name"], subjects)
extender_rules = next(d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == extender)["rules"]
verbs = {v for r in extender_rules for v in r["verbs"]}
assert "delete" not in verbs and not any("resourceclaims" in " ".join(r["resources"]) for r in extender_rules), extender_rules
print("ok")
PY
)"; then
	pass "scheduler pod: the extender's token and kube-scheduler's own, each in its container only; the extender cannot delete pods or write claims"
else
	printf '%s\n' "$report" >&2
	fail "scheduler pod identities"
fi

render "$WORK/policies.yaml" --show-only templates/admission/policies.yaml --show-only templates/admission/container-isolation.yaml
expect_not "no policy has an object selector" "$WORK/policies.yaml" 'objectSelector:'
render "$WORK/exempt.yaml" --set 'admissionPolicy.exemptNamespaces[0]=gpu-operator' --set 'global.gpuHookPath=/opt/hamihook'
expect "exemptNamespaces extend the isolation policy's namespace exemption" "$WORK/exempt.yaml" '^            - gpu-operator$'
expect "the isolation policy guards the node's hook directory" "$WORK/exempt.yaml" "hostPath\.path\.matches\(r'.*opt.*hamihook.*vgpu"
render "$WORK/dra-policies.yaml" --set dra.enabled=true
expect_count "with DRA, five ValidatingAdmissionPolicies" "$WORK/dra-policies.yaml" '^kind: ValidatingAdmissionPolicy$' 5
expect "the DRA plugin writes only its own node's slices" "$WORK/dra-policies.yaml" 's.spec.nodeName == variables.nodeName'
render "$WORK/volume-mounts.yaml" --set devicePlugin.deviceListStrategy=volume-mounts
expect "deviceListStrategy reaches the device plugin" "$WORK/volume-mounts.yaml" '^            - --device-list-strategy=volume-mounts$'
expect "the unaccounted-process watch reports by default" "$D" '^            - --unaccounted-process-policy=report$'
expect_not "report never grants pod deletion" "$D" '^    verbs: \[delete\]$'
render "$WORK/evict.yaml" --set devicePlugin.unaccountedProcesses.policy=evict --set 'devicePlugin.unaccountedProcesses.allowedHostCgroups[0]=/system.slice/nvidia-persistenced.service'
expect "evict reaches the device plugin" "$WORK/evict.yaml" '^            - --unaccounted-process-policy=evict$'
expect "allowed host cgroups reach the device plugin" "$WORK/evict.yaml" '^            - --unaccounted-allowed-host-cgroups=/system.slice/nvidia-persistenced.service$'
expect "evict grants pod deletion" "$WORK/evict.yaml" '^    verbs: \[delete\]$'
expect "evict lets the plugin delete pods, on its own node only" "$WORK/evict.yaml" "request.operation == 'DELETE' && !variables.isNode && \(!has\(request.subResource\) \|\| request.subResource == ''\) && true"
render "$WORK/unaccounted-off.yaml" --set devicePlugin.unaccountedProcesses.policy=off
expect "off reaches the device plugin" "$WORK/unaccounted-off.yaml" '^            - --unaccounted-process-policy=off$'
if render "$WORK/unaccounted-bad.yaml" --set devicePlugin.unaccountedProcesses.policy=kill 2>/dev/null; then
	fail "an unknown unaccountedProcesses.policy must fail the install"
else
	pass "an unknown unaccountedProcesses.policy fails the install"
fi
# The DRA plugin runs the same watch on DRA nodes (dra.unaccountedProcesses), with the same flags.
expect "[dra] the DRA plugin may delete no pod under report" "$WORK/dra-policies.yaml" "variables.isSlice \|\| \(request.operation == 'DELETE' && \(!has\(request.subResource\) \|\| request.subResource == ''\) && false\)"
render "$WORK/dra-watch.yaml" --set dra.enabled=true --show-only templates/dra/daemonset.yaml --show-only templates/dra/rbac.yaml
expect "[dra] the unaccounted-process watch reports by default" "$WORK/dra-watch.yaml" '^            - --unaccounted-process-policy=report$'
expect "[dra] the watch's period reaches the DRA plugin" "$WORK/dra-watch.yaml" '^            - --unaccounted-period-seconds=15$'
expect "[dra] the watching DRA plugin has the host's PIDs" "$WORK/dra-watch.yaml" '^      hostPID: true$'
expect "[dra] the watch reads its node's pods" "$WORK/dra-watch.yaml" '^    verbs: \[list, watch\]$'
expect "[dra] the watch writes Events" "$WORK/dra-watch.yaml" '^    resources: \[events\]$'
expect_not "[dra] report never grants the DRA plugin pod deletion" "$WORK/dra-watch.yaml" '^    verbs: \[delete\]$'
render "$WORK/dra-evict.yaml" --set dra.enabled=true --set dra.unaccountedProcesses.policy=evict --set 'dra.unaccountedProcesses.allowedHostCgroups[0]=/system.slice/nvidia-persistenced.service' --set dra.unaccountedProcesses.periodSeconds=5
expect "[dra] evict reaches the DRA plugin" "$WORK/dra-evict.yaml" '^            - --unaccounted-process-policy=evict$'
expect "[dra] allowed host cgroups reach the DRA plugin" "$WORK/dra-evict.yaml" '^            - --unaccounted-allowed-host-cgroups=/system.slice/nvidia-persistenced.service$'
expect "[dra] the watch's period is the value's" "$WORK/dra-evict.yaml" '^            - --unaccounted-period-seconds=5$'
expect_count "[dra] evict grants pod deletion to the DRA plugin only" "$WORK/dra-evict.yaml" '^    verbs: \[delete\]$' 1
expect "[dra] evict lets the DRA plugin delete pods" "$WORK/dra-evict.yaml" "variables.isSlice \|\| \(request.operation == 'DELETE' && \(!has\(request.subResource\) \|\| request.subResource == ''\) && true\)"
expect "[dra] the DRA plugin deletes only pods on its own node" "$WORK/dra-evict.yaml" "variables.isSlice \|\| \(oldObject != null && has\(oldObject.spec.nodeName\) && oldObject.spec.nodeName == variables.nodeName\)"
expect_count "[dra] still five ValidatingAdmissionPolicies" "$WORK/dra-evict.yaml" '^kind: ValidatingAdmissionPolicy$' 5
render "$WORK/dra-unaccounted-off.yaml" --set dra.enabled=true --set dra.unaccountedProcesses.policy=off --show-only templates/dra/daemonset.yaml --show-only templates/dra/rbac.yaml
expect "[dra] off reaches the DRA plugin" "$WORK/dra-unaccounted-off.yaml" '^            - --unaccounted-process-policy=off$'
expect "[dra] without the watch, hostPID still for the claim directories' limit (the host's mount table)" "$WORK/dra-unaccounted-off.yaml" '^      hostPID: true$'
expect "[dra] claim directories limited like the device plugin's containers'" "$WORK/dra-unaccounted-off.yaml" '^            - --cache-dir-limit-mib=16$'
render "$WORK/dra-nothing-host.yaml" --set dra.enabled=true --set dra.unaccountedProcesses.policy=off --set devicePlugin.cacheDirLimit.sizeMiB=0 --show-only templates/dra/daemonset.yaml
expect_not "[dra] without the watch and the limit no hostPID, no propagation" "$WORK/dra-nothing-host.yaml" 'hostPID|mountPropagation: Bidirectional|cache-dir-limit'
expect_not "[dra] without the watch no pods or Events" "$WORK/dra-unaccounted-off.yaml" 'resources: \[(pods|events)\]'
if render "$WORK/dra-unaccounted-bad.yaml" --set dra.enabled=true --set dra.unaccountedProcesses.policy=kill 2>/dev/null; then
	fail "an unknown dra.unaccountedProcesses.policy must fail the install"
else
	pass "an unknown dra.unaccountedProcesses.policy fails the install"
fi
if render "$WORK/cdi-cri.yaml" --set devicePlugin.deviceListStrategy=cdi-cri 2>/dev/null; then
	fail "deviceListStrategy cdi-cri must fail the install"
else
	pass "deviceListStrategy cdi-cri fails the install"
fi
expect "booking policy covers pods and pods/status" "$D" '^        resources: \[pods, pods/status\]$'
expect "booking policy covers the annotations of Bindings" "$D" '^        resources: \[pods/binding\]$'
expect "the extender's write order is rendered" "$D" '^            - --write-decision-at-filter=false$'
expect "the extender writes warning Events only by default" "$D" '^            - --pod-events=warnings$'
expect "booking policy trusts only the chart's two identities" "$D" "^        !\\(request.userInfo.username in \\['system:serviceaccount:$NAMESPACE:$RELEASE-scheduler', 'system:serviceaccount:$NAMESPACE:$RELEASE-device-plugin'\\]\\)\$"
expect "plugin policy reads the token's node claim" "$D" "authentication.kubernetes.io/node-name"
# Every key hami-contract lists as scheduler-owned is protected by the booking policy.
owned_names=$(awk '/^pub const SCHEDULER_OWNED/ {on=1; next} on && /^\];/ {exit} on {gsub(/[ ,]/, ""); print}' "$ROOT/hami-contract/src/annotations.rs")
for name in $owned_names; do
	key=$(sed -nE "s/^pub const $name: &str = \"([^\"]+)\";$/\1/p" "$ROOT/hami-contract/src/annotations.rs")
	expect "booking policy protects $key" "$D" "k in \\[[^]]*'$key'"
done
expect_not "no /tmp/vgpulock mount" "$D" 'vgpulock'
expect_not "hook containers directory is not world-writable" "$D" 'chmod 0?777'
expect "device plugin serves the GPU scheduler's pods only" "$D" '^            - --scheduler-name=hami-scheduler$'
if awk '/^kind: ClusterRole$/ {r=1} r && /^  name: / {n=$2} /^---/ {r=0; n=""} r && n ~ /-scheduler$/ && /resources: \[nodes\]/ {getline; print}' "$D" | grep -q patch; then
	fail "the scheduler's ClusterRole must not patch nodes"
else
	pass "the scheduler's ClusterRole cannot patch nodes"
fi
render "$WORK/trusted.yaml" --set 'admissionPolicy.additionalTrustedUsers[0]=system:serviceaccount:kube-system:hami-device-plugin'
expect "additionalTrustedUsers extend the booking policy" "$WORK/trusted.yaml" "'system:serviceaccount:kube-system:hami-device-plugin'\\]\\)\$"

# kube-scheduler's Helm-generated client certificate must chain to the CA the extender trusts and
# carry the clientAuth usage (rustls/webpki refuses a client certificate without it).
if command -v openssl >/dev/null 2>&1; then
	awk '/^kind: Secret$/ {s=1} s && /^  name: / {n=$2} s && n ~ /-extender-client$/ && /^  (tls\.crt|ca\.crt): / {print $1, $2} /^---/ {s=0; n=""}' "$D" |
		while read -r key value; do printf '%s' "$value" | base64 -d >"$WORK/${key%:}"; done
	if [[ -s "$WORK/tls.crt" && -s "$WORK/ca.crt" ]] &&
		openssl verify -purpose sslclient -CAfile "$WORK/ca.crt" "$WORK/tls.crt" >/dev/null 2>&1; then
		pass "extender client certificate chains to its CA with the clientAuth usage"
	else
		fail "extender client certificate does not verify as a TLS client certificate"
	fi
	# The serving certificate chains to the CA in the webhook's caBundle and names the Service.
	rm -f "$WORK/tls.crt" "$WORK/ca.crt"
	awk '/^kind: Secret$/ {s=1} s && /^  name: / {n=$2} s && n ~ /-scheduler-tls$/ && /^  (tls\.crt|ca\.crt): / {print $1, $2} /^---/ {s=0; n=""}' "$D" |
		while read -r key value; do printf '%s' "$value" | base64 -d >"$WORK/${key%:}"; done
	sed -nE 's/^      caBundle: (.*)$/\1/p' "$D" | base64 -d >"$WORK/bundle.crt"
	if [[ -s "$WORK/tls.crt" ]] && cmp -s "$WORK/ca.crt" "$WORK/bundle.crt" &&
		openssl verify -purpose sslserver -CAfile "$WORK/bundle.crt" "$WORK/tls.crt" >/dev/null 2>&1 &&
		openssl x509 -noout -ext subjectAltName -in "$WORK/tls.crt" 2>/dev/null | grep -q "DNS:$RELEASE-scheduler.$NAMESPACE.svc"; then
		pass "serving certificate chains to the webhook's caBundle and names the Service"
	else
		fail "serving certificate does not verify against the webhook's caBundle"
	fi
else
	skip "openssl not installed, client certificate usage not checked"
fi

H="$WORK/http-only.yaml"
expect "[http-only] extender on loopback only" "$H" '^            - --http-bind=127.0.0.1:443$'
expect "[http-only] kube-scheduler uses plain HTTP" "$H" 'urlPrefix: "http://127.0.0.1:443"'
expect_not "[http-only] no webhook" "$H" '^kind: MutatingWebhookConfiguration$'
# (kube-scheduler's service-account token Secret is not a certificate.)
expect_not "[http-only] no certificate Jobs or Secrets" "$H" '^kind: Job$|^type: kubernetes.io/tls$'
DRA="$WORK/dra.yaml"
expect "[dra] the DeviceClass of driver gpu.tessera.dev" "$DRA" '^kind: DeviceClass$'
expect "[dra] the class serves the extended resource" "$DRA" '^  extendedResourceName: example.com/gpu$'
expect "[dra] the DRA plugin's DaemonSet" "$DRA" '^            - /usr/bin/tessera-dra-plugin$'
expect "[dra] the device plugin stays off DRA nodes" "$DRA" '^                    operator: NotIn$'
expect_not "[default] no DRA objects without dra.enabled" "$WORK/default.yaml" '(^kind: DeviceClass$|tessera-dra-plugin)'

N="$WORK/webhook-disabled.yaml"
expect_not "[webhook-disabled] no webhook" "$N" '^kind: MutatingWebhookConfiguration$'
expect_not "[webhook-disabled] no caBundle" "$N" 'caBundle:'
expect "[webhook-disabled] serving certificate still issued" "$N" "^  name: $RELEASE-scheduler-tls\$"

P="$WORK/pod-mutation-policy.yaml"
expect_not "[pod-mutation-policy] no webhook: the API server mutates" "$P" '^kind: MutatingWebhookConfiguration$'
expect_count "[pod-mutation-policy] the mutating policy and its binding (v1beta1 without a cluster that serves v1)" "$P" '^apiVersion: admissionregistration.k8s.io/v1beta1$' 2
expect "[pod-mutation-policy] the webhook's refusals as a validating policy" "$P" "^  name: $RELEASE-pod-requests\$"
expect "[pod-mutation-policy] the core policy env" "$P" "name: 'GPU_CORE_UTILIZATION_POLICY', value: 'force'"
expect "[pod-mutation-policy] the runtime class" "$P" "runtimeClassName: .*optional.of\\('nvidia'\\)"
expect "[pod-mutation-policy] memoryFactor divides the int32 bound" "$P" "quantity\('1073741823'\)"
expect_not "[pod-mutation-policy] overwriteEnv sees every pod" "$P" 'name: gpu-pod-or-hami-metadata'
expect_not "[defaults] no pod-mutation policy" "$WORK/default.yaml" 'kind: MutatingAdmissionPolicy$'

C="$WORK/cert-manager.yaml"
expect "[cert-manager] CA injected into the webhook" "$C" "cert-manager.io/inject-ca-from: $NAMESPACE/$RELEASE-scheduler-tls"
expect_count "[cert-manager] serving and client certificates plus CA" "$C" '^kind: Certificate$' 3
expect "[cert-manager] client certificate for kube-scheduler" "$C" '^  usages: \[client auth, digital signature, key encipherment\]$'
expect_not "[cert-manager] no certificate Jobs" "$C" '^kind: Job$'
expect_not "[cert-manager] no Helm-issued certificates" "$C" '^type: kubernetes.io/tls$|checksum/serving-cert'
expect_count "[cert-manager] ServiceMonitors for both daemons" "$C" '^kind: ServiceMonitor$' 2
expect "[cert-manager] Grafana dashboard" "$C" '"uid": "tessera-gpu"'

A="$WORK/ha.yaml"
expect "[ha] three scheduler replicas" "$A" '^  replicas: 3$'
expect "[ha] PDB keeps two" "$A" '^  minAvailable: 2$'

R="$WORK/custom-resource-names.yaml"
expect "[custom-names] device config uses the custom count name" "$R" '^      resourceCountName: "example.com/vgpu"$'
expect "[custom-names] extender manages the custom names" "$R" '^          - name: example.com/vgpu-memory$'
expect "[custom-names] custom scheduler name" "$R" '^            - --scheduler-name=gpu-share-scheduler$'
expect "[custom-names] node label selector" "$R" '^            - --node-label-selector=gpu-pool=shared,tier=1$'
expect_count "[custom-names] global.imageRegistry replaces every registry" "$R" '^ +image: registry.example.com/(tessera-gpu/tessera-(scheduler|device-plugin)|kube-scheduler):' 4
expect_count "[custom-names] every image" "$R" '^ +image: ' 4
expect "[custom-names] hook path follows gpuHookPath" "$R" '^            path: /opt/gpu-hook/vgpu$'
expect "[custom-names] per-node config rendered" "$R" '"name": "node-a"'
expect_not "[custom-names] overwriteEnv sends every pod to the webhook" "$R" 'name: gpu-pod-or-hami-metadata'

# HAMi v2.10's default values, unchanged (rendered with --kube-version $K8S_SCHEMA_VERSION above).
M="$WORK/hami-v2.10.yaml"
KUBE_TAG="v${K8S_SCHEMA_VERSION#v}"
APP_VERSION="$(sed -nE 's/^appVersion: "?([^"]*)"?$/\1/p' "$CHART/Chart.yaml")"
expect "[hami-v2.10] Tessera's device plugin image, not HAMi's" "$M" "^          image: ghcr.io/tessera-gpu/tessera-device-plugin:$APP_VERSION\$"
expect "[hami-v2.10] Tessera's scheduler image, not HAMi's" "$M" "^          image: ghcr.io/tessera-gpu/tessera-scheduler:$APP_VERSION\$"
expect "[hami-v2.10] kube-scheduler at the cluster's version" "$M" "^          image: registry.cn-hangzhou.aliyuncs.com/google_containers/kube-scheduler:$KUBE_TAG\$"
expect_count "[hami-v2.10] only those images" "$M" "^ +image: (ghcr.io/tessera-gpu/tessera-(device-plugin|scheduler):$APP_VERSION|registry.cn-hangzhou.aliyuncs.com/google_containers/kube-scheduler:$KUBE_TAG)\$" "$(grep -Ec '^ +image: ' "$M")"
expect_not "[hami-v2.10] no HAMi or certgen image, no HAMi release tag" "$M" 'projecthami|kube-webhook-certgen|:v2\.10\.0'
awk '$0 ~ "^            - kube-scheduler$" {on=1; next} on && /^ *#/ {next} on && /^            - / {sub(/^            - /, ""); print; next} on {exit}' "$M" >"$WORK/hami-kube-scheduler.args"
expect "[hami-v2.10] kube-scheduler gets extraNewArgs (-v=4)" "$WORK/hami-kube-scheduler.args" '^-v=4$'
expect_not "[hami-v2.10] kube-scheduler never gets --policy-config-file (extraArgs, < 1.22 only)" "$WORK/hami-kube-scheduler.args" 'policy-config-file'
expect_count "[hami-v2.10] kube-scheduler reads exactly one --config, the chart's" "$WORK/hami-kube-scheduler.args" '^--config=/config/config.yaml$' 1
expect_count "[hami-v2.10] no other --config" "$WORK/hami-kube-scheduler.args" 'config' 1
expect "[hami-v2.10] device plugin idles instead of crash-looping without a driver" "$M" '^            - --fail-on-init-error=false$'
expect "[hami-v2.10] HAMi's node config text is config.json itself" "$M" '^      "nodeconfig": \[$'
expect "[hami-v2.10] webhook caBundle from the Helm-issued CA" "$M" '^      caBundle: [A-Za-z0-9+/=]{100,}$'
expect "[hami-v2.10] device plugin monitor Service on HAMi's node port 31992" "$M" '^      nodePort: 31992$'
expect "[hami-v2.10] scheduler metrics on HAMi's node port 31993" "$M" '^      nodePort: 31993$'
expect "[hami-v2.10] scheduler https on HAMi's node port 31998" "$M" '^      nodePort: 31998$'
expect_count "[hami-v2.10] both Services are NodePort, as in HAMi's values" "$M" '^  type: NodePort$' 2
render "$WORK/envs-list.yaml" -f "$HAMI_VALUES" --set-json 'devicePlugin.extraEnvs=[{"name":"FROM_LIST","value":"1"}]' --set-json 'devicePlugin.extraEnv=[{"name":"TESSERA_FORM","value":"2"}]'
if grep -A1 -- '- name: FROM_LIST$' "$WORK/envs-list.yaml" | grep -q 'value: "1"' && grep -q -- '- name: TESSERA_FORM$' "$WORK/envs-list.yaml"; then
	pass "[hami-v2.10] devicePlugin.extraEnvs as a list of EnvVars, beside devicePlugin.extraEnv"
else
	fail "[hami-v2.10] devicePlugin.extraEnvs as a list"
fi
render "$WORK/envs-map.yaml" -f "$HAMI_VALUES" --set-json 'devicePlugin.extraEnvs={"FROM_MAP":"on","FROM_REF":{"valueFrom":{"fieldRef":{"fieldPath":"spec.nodeName"}}}}'
if grep -A1 -- '- name: FROM_MAP$' "$WORK/envs-map.yaml" | grep -q 'value: "on"' && grep -A2 -- '- name: FROM_REF$' "$WORK/envs-map.yaml" | grep -q 'fieldRef:'; then
	pass "[hami-v2.10] devicePlugin.extraEnvs as a map of names to values or references"
else
	fail "[hami-v2.10] devicePlugin.extraEnvs as a map"
fi
kubeconform_check "$WORK/envs-map.yaml" >/dev/null && pass "[hami-v2.10] extraEnvs map renders valid objects" || fail "[hami-v2.10] extraEnvs map: kubeconform"
render "$WORK/pull.yaml" -f "$HAMI_VALUES" --set-json 'global.imagePullSecrets=["g"]' --set-json 'scheduler.extender.image.pullSecrets=["e","g"]' --set-json 'scheduler.kubeScheduler.image.pullSecrets=[{"name":"k"}]' --set-json 'devicePlugin.image.pullSecrets=["d"]'
expect_count "[hami-v2.10] per-image pullSecrets join global.imagePullSecrets, once each" "$WORK/pull.yaml" '^        - name: (g|e|k|d)$' 5

# Every leaf key of HAMi v2.10's values: honoured (the render changes), refused (the install fails
# naming the key) or another vendor's (unused), per charts/tessera/files/hami-v2.10-keys.yaml.
if python3 "$ROOT/e2e/hami-values-test.py" "$HELM" "$CHART" "$HAMI_VALUES" "$K8S_SCHEMA_VERSION" >"$WORK/hami-keys.log" 2>&1; then
	pass "[hami-v2.10] $(grep -c '^ok:' "$WORK/hami-keys.log") per-key checks: $(tail -1 "$WORK/hami-keys.log" | sed 's/^hami-values-test: //')"
else
	grep -E '^FAIL:|^hami-values-test:' "$WORK/hami-keys.log" >&2 || cat "$WORK/hami-keys.log" >&2
	fail "[hami-v2.10] values parity (e2e/hami-values-test.py)"
fi
# The counts docs/helm.md and the README state are the ones the parity test counted.
summary=$(tail -1 "$WORK/hami-keys.log")
count_of() { grep -oE "[0-9]+ $1" <<<"$summary" | head -1 | cut -d' ' -f1 || true; }
total=$(count_of 'leaf keys')
honoured=$(count_of honoured)
refused=$(count_of refused)
skipped=$(count_of vendor-skipped)
if [[ -z "$total" || -z "$honoured" || -z "$refused" || -z "$skipped" ]]; then
	fail "the parity test's summary line has no counts: $summary"
elif grep -qE "^\| honoured \| $honoured \|" "$ROOT/docs/helm.md" &&
	grep -qE "^\| refused \| $refused \|" "$ROOT/docs/helm.md" &&
	grep -qE "^\| vendor-skipped \| $skipped \|" "$ROOT/docs/helm.md" &&
	grep -q "each of the $total keys of HAMi's values" "$ROOT/README.md"; then
	pass "docs/helm.md and the README state the counted keys ($total: $honoured honoured, $refused refused, $skipped vendor-skipped)"
else
	fail "docs/helm.md's disposition table or the README's key count differs from the parity test's: $summary"
fi
if render "$WORK/old-kube.yaml" -f "$HAMI_VALUES" --show-only templates/scheduler/deployment.yaml --kube-version v1.21.0 2>/dev/null; then
	fail "[hami-v2.10] Kubernetes 1.21 must be refused (Chart.yaml kubeVersion)"
else
	pass "[hami-v2.10] Kubernetes < 1.30 is refused by Chart.yaml's kubeVersion"
fi

# Impossible combinations must fail at render time, with an explanation.
if render "$WORK/bad.yaml" --set scheduler.enableHTTPS=false 2>"$WORK/bad.err"; then
	fail "webhook without HTTPS must be refused"
else
	grep -q 'only calls webhooks over HTTPS' "$WORK/bad.err" && pass "webhook without HTTPS is refused" || fail "webhook without HTTPS: unclear error: $(cat "$WORK/bad.err")"
fi
if render "$WORK/bad.yaml" --set scheduler.replicas=2 --set scheduler.leaderElect=false 2>"$WORK/bad.err"; then
	fail "several replicas without leader election must be refused"
else
	pass "several replicas without leader election are refused"
fi
if render "$WORK/bad.yaml" --set scheduler.podEvents=some 2>"$WORK/bad.err"; then
	fail "an unknown scheduler.podEvents must be refused"
else
	grep -q 'scheduler.podEvents must be' "$WORK/bad.err" && pass "an unknown scheduler.podEvents is refused" || fail "scheduler.podEvents: unclear error: $(cat "$WORK/bad.err")"
fi
if render "$WORK/bad.yaml" --set devicePlugin.libPath=/opt/hamihook/vgpu 2>"$WORK/bad.err"; then
	fail "a devicePlugin.libPath other than /usr/local/vgpu must be refused"
else
	grep -q 'devicePlugin.libPath is "/opt/hamihook/vgpu", but Tessera mounts the shim at /usr/local/vgpu' "$WORK/bad.err" && pass "a moved devicePlugin.libPath is refused" || fail "devicePlugin.libPath: unclear error: $(cat "$WORK/bad.err")"
fi
render "$WORK/lib.yaml" --set devicePlugin.libPath=/usr/local/vgpu/ >/dev/null && pass "devicePlugin.libPath with a trailing slash is accepted" || fail "devicePlugin.libPath=/usr/local/vgpu/ must render"
expect "[custom-names] ld.so.preload names the container's shim path" "$R" '^              echo /usr/local/vgpu/libvgpu.so > '
render "$WORK/topo.yaml" --set scheduler.defaultSchedulerPolicy.gpuSchedulerPolicy=topology-aware
expect "[topology-aware] the device plugin publishes pair scores" "$WORK/topo.yaml" '^ +- --enable-topology-score$'
expect "[topology-aware] the extender's default policy" "$WORK/topo.yaml" '^ +- --gpu-scheduler-policy=topology-aware$'
if render "$WORK/bad.yaml" --set resourceName=gpu 2>"$WORK/bad.err"; then
	fail "an invalid resource name must be refused"
else
	pass "an invalid resource name is refused"
fi

# --- 4. The chart against the daemons it starts (when they are built) ------------------------------
# Every flag the chart passes must exist in the daemon's --help, and the rendered
# device-config.yaml must load with the scheduler's own parser. Built by `cargo build`/`cargo test`;
# override the directory with TESSERA_BIN_DIR.
BIN_DIR="${TESSERA_BIN_DIR:-${CARGO_TARGET_DIR:-$ROOT/target}/debug}"
container_flags() { # container_flags RENDERED BINARY_PATH: the --flags of that container's command
	awk -v bin="$2" '$0 ~ "^            - " bin "$" {on=1; next} on && /^ *#/ {next} on && /^            - --/ {sub(/^            - /, ""); sub(/=.*/, ""); print; next} on && !/^            - / {exit}' "$1" | sort -u
}
container_args() { # container_args RENDERED BINARY_PATH: every argument of that container's command, one a line
	awk -v bin="$2" '$0 ~ "^            - " bin "$" {on=1; next} on && /^ *#/ {next} on && /^            - / {sub(/^            - /, ""); gsub(/^["\x27]|["\x27]$/, ""); print; next} on {exit}' "$1"
}
check_args() { # check_args NAME BINARY RENDERED BINARY_PATH: the daemon parses the chart's exact argument list
	local name="$1" bin="$2" list err
	local -a argv=()
	list="$(container_args "$3" "$4")"
	[[ -n "$list" ]] || return 0
	mapfile -t argv <<<"$list"
	# --help last: clap rejects an unknown flag or a bad value met before it, and stops there.
	if err="$("$bin" "${argv[@]}" --help 2>&1 >/dev/null)"; then
		pass "$name parses the chart's ${#argv[@]} arguments"
	else
		printf '%s\n' "$err" | head -5 >&2
		fail "$name refuses the chart's arguments: ${argv[*]}"
	fi
}
check_flags() { # check_flags NAME BINARY HELP_ARGS... (flags read from $flags_file)
	local name="$1" bin="$2"; shift 2
	local help missing=()
	help="$("$bin" "$@" --help 2>&1)" || { fail "$name --help failed"; return; }
	while read -r flag; do
		[[ -n "$flag" ]] || continue
		grep -Eq -- "^ +(-[a-zA-Z], )?$flag( |\\[|$)" <<<"$help" || missing+=("$flag")
	done <"$flags_file"
	if [[ ${#missing[@]} -eq 0 ]]; then
		pass "$name accepts every flag the chart passes ($(wc -l <"$flags_file") flags)"
	else
		fail "$name does not know: ${missing[*]}"
	fi
}
if [[ -x "$BIN_DIR/tessera-scheduler" ]]; then
	flags_file="$WORK/scheduler.flags"
	for set in "${value_sets[@]}"; do container_flags "$WORK/$set.yaml" /usr/bin/tessera-scheduler; done | sort -u >"$flags_file"
	check_flags tessera-scheduler "$BIN_DIR/tessera-scheduler" serve
	for set in "${value_sets[@]}"; do check_args "[$set] tessera-scheduler" "$BIN_DIR/tessera-scheduler" "$WORK/$set.yaml" /usr/bin/tessera-scheduler; done
	for set in "${value_sets[@]}"; do
		awk '/^  device-config.yaml: \|/ {on=1; next} on && /^    / {print substr($0, 5); next} on {exit}' "$WORK/$set.yaml" >"$WORK/$set.device-config.yaml"
		if err="$("$BIN_DIR/tessera-scheduler" simulate --device-config "$WORK/$set.device-config.yaml" -f "$ROOT/examples/simulate/cluster.yaml" 2>&1 >/dev/null)"; then
			pass "[$set] device-config.yaml loads with tessera-scheduler's parser"
		else
			printf '%s\n' "$err" | head -5 >&2
			fail "[$set] device-config.yaml is refused by tessera-scheduler"
		fi
	done
else
	skip "$BIN_DIR/tessera-scheduler not built; daemon flag and device-config checks not run"
fi
if [[ -x "$BIN_DIR/tessera-device-plugin" ]]; then
	flags_file="$WORK/device-plugin.flags"
	for set in "${value_sets[@]}"; do container_flags "$WORK/$set.yaml" /usr/bin/tessera-device-plugin; done | sort -u >"$flags_file"
	check_flags tessera-device-plugin "$BIN_DIR/tessera-device-plugin"
	for set in "${value_sets[@]}"; do check_args "[$set] tessera-device-plugin" "$BIN_DIR/tessera-device-plugin" "$WORK/$set.yaml" /usr/bin/tessera-device-plugin; done
else
	skip "$BIN_DIR/tessera-device-plugin not built; device plugin flag check not run"
fi
if [[ -x "$BIN_DIR/tessera-dra-plugin" ]]; then
	flags_file="$WORK/dra-plugin.flags"
	for set in "${value_sets[@]}"; do container_flags "$WORK/$set.yaml" /usr/bin/tessera-dra-plugin; done | sort -u >"$flags_file"
	check_flags tessera-dra-plugin "$BIN_DIR/tessera-dra-plugin"
	for set in "${value_sets[@]}"; do check_args "[$set] tessera-dra-plugin" "$BIN_DIR/tessera-dra-plugin" "$WORK/$set.yaml" /usr/bin/tessera-dra-plugin; done
else
	skip "$BIN_DIR/tessera-dra-plugin not built; DRA plugin flag check not run"
fi

if [[ "$FAILURES" -gt 0 ]]; then
	echo "chart-test: $FAILURES check(s) FAILED" >&2
	exit 1
fi
echo "chart-test: all checks passed"
