#!/usr/bin/env bash
# Builds the pinned chart tooling (helm, kubeconform) with `go install` and generates the
# Kubernetes JSON schemas kubeconform validates against, all offline except for the Go module
# proxy. Everything lands in a cache keyed by version, so a second run only checks that the
# files are there:
#
#   ${TESSERA_CACHE:-$HOME/.cache/tessera}/tools/helm-<v>/helm
#   ${TESSERA_CACHE:-$HOME/.cache/tessera}/tools/kubeconform-<v>/kubeconform
#   ${TESSERA_CACHE:-$HOME/.cache/tessera}/tools/k8s-schemas-<v>/{<kind>-<group>-<version>.json, strict/...}
#   ${TESSERA_CACHE:-$HOME/.cache/tessera}/tools/chartcheck-<k8s v>-r<n>/chartcheck
#   ${TESSERA_CACHE:-$HOME/.cache/tessera}/tools/promtool-<v>/promtool
#   ${TESSERA_CACHE:-$HOME/.cache/tessera}/tools/actionlint-<v>/actionlint
#   ${TESSERA_CACHE:-$HOME/.cache/tessera}/tools/kueue-<v>/{kueue, chart/}
#   ${TESSERA_CACHE:-$HOME/.cache/tessera}/tools/krew-<v>/krew
#
# Prints `NAME=PATH` lines on stdout (eval-able); progress goes to stderr.
#
# Why schemas are generated here: kubeconform downloads its schemas from GitHub by default, which
# is not reachable. The authoritative OpenAPI v2 document of a Kubernetes release,
# `api/openapi-spec/swagger.json`, ships inside the Go module `k8s.io/kubernetes@<release>`, which
# the module proxy serves. The small generator embedded below turns every definition that carries
# `x-kubernetes-group-version-kind` into one standalone JSON schema per kind (all `$ref`s inlined),
# the same layout as yannh/kubernetes-json-schema's `-standalone` and `-standalone-strict` trees.
#
# `chartcheck` (also embedded below) covers what no OpenAPI schema does: it decodes the chart's
# KubeSchedulerConfiguration strictly with kube-scheduler's own v1 types, and evaluates the
# webhook's CEL matchConditions with the API server's own matcher (k8s.io/apiserver) on sample pods.
set -euo pipefail

HELM_VERSION="${TESSERA_HELM_VERSION:-v3.19.5}"
# The Kubernetes minor of the client-go that HELM_VERSION is built with (v3.19.x: client-go v0.34).
# helm's release Makefile stamps it, and `helm template`/`helm lint` then assume that version when
# no cluster is asked; a plain `go install` would leave helm's fallback, v1.20.
HELM_K8S_MINOR="${TESSERA_HELM_K8S_MINOR:-34}"
KUBECONFORM_VERSION="${TESSERA_KUBECONFORM_VERSION:-v0.7.0}"
# The Kubernetes release whose API the chart is validated against (kubeconform -kubernetes-version).
K8S_SCHEMA_VERSION="${TESSERA_K8S_SCHEMA_VERSION:-v1.34.4}"
# Bump when the generator below changes, so stale schemas are never reused.
SCHEMA_GENERATOR_REVISION=1
# Staging-module release matching K8S_SCHEMA_VERSION (v1.X.Y <-> v0.X.Y), for chartcheck.
K8S_STAGING_VERSION="v0.${K8S_SCHEMA_VERSION#v1.}"
# promtool, for the chart's PrometheusRule (check and unit tests). Prometheus v3.x's module
# versions are v0.3XX.Y (v0.316.0 is Prometheus 3.16.0).
PROMTOOL_VERSION="${TESSERA_PROMTOOL_VERSION:-v0.316.0}"
# actionlint, for .github/workflows/ (scripts/lint-workflows.sh).
ACTIONLINT_VERSION="${TESSERA_ACTIONLINT_VERSION:-v1.7.12}"
# Kueue, for the real-node test that queues GPU Jobs with quotas on Tessera's resources: its
# manager binary from its Go module, and its Helm chart from the same module's files.
KUEUE_VERSION="${TESSERA_KUEUE_VERSION:-v0.17.0}"
# krew, which installs `kubectl tessera` from the release's manifest (scripts/krew-check.sh).
KREW_VERSION="${TESSERA_KREW_VERSION:-v0.4.3}"
# Bump when chartcheck's source below changes.
CHARTCHECK_REVISION=1

CACHE="${TESSERA_CACHE:-$HOME/.cache/tessera}"
TOOLS="$CACHE/tools"

log() { printf 'tools.sh: %s\n' "$*" >&2; }

command -v go >/dev/null 2>&1 || { log "error: the Go toolchain is required (go install builds helm and kubeconform)"; exit 1; }
# Never let `go` fetch a different toolchain behind our back; fail loudly instead.
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
export CGO_ENABLED=0

# go_install NAME PACKAGE VERSION [LDFLAGS]: installs PACKAGE@VERSION into $TOOLS/NAME-VERSION/
# unless the binary is already there. The build goes to a temporary GOBIN and is moved in place
# only when it succeeded, so an interrupted build never leaves a half-written binary that a later
# run trusts.
go_install() {
	local name="$1" pkg="$2" version="$3" ldflags="${4:-}"
	local dir="$TOOLS/$name-$version"
	if [[ -x "$dir/$name" ]]; then
		return 0
	fi
	log "building $name $version (go install $pkg@$version; one-time cost)"
	local tmp
	tmp="$(mktemp -d "$TOOLS/.build-$name-XXXXXX")"
	GOBIN="$tmp" nice -n 19 go install -trimpath -ldflags "-s -w $ldflags" "$pkg@$version"
	mkdir -p "$dir"
	mv -f "$tmp/$name" "$dir/$name"
	rmdir "$tmp"
}

generate_schemas() {
	local dir="$TOOLS/k8s-schemas-$K8S_SCHEMA_VERSION"
	local stamp="$dir/.complete-r$SCHEMA_GENERATOR_REVISION"
	if [[ -f "$stamp" ]]; then
		return 0
	fi
	log "generating JSON schemas for Kubernetes $K8S_SCHEMA_VERSION from k8s.io/kubernetes@$K8S_SCHEMA_VERSION/api/openapi-spec/swagger.json (one-time cost)"
	local gen="$TOOLS/.schemagen-r$SCHEMA_GENERATOR_REVISION"
	mkdir -p "$gen"
	write_schema_generator "$gen"
	# `go mod download` fetches the release's module zip through the proxy; only swagger.json is read.
	local module_dir
	module_dir="$(cd "$gen" && go mod download -json "k8s.io/kubernetes@$K8S_SCHEMA_VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
	local swagger="$module_dir/api/openapi-spec/swagger.json"
	[[ -f "$swagger" ]] || { log "error: $swagger not found after go mod download"; exit 1; }
	local tmp
	tmp="$(mktemp -d "$TOOLS/.schemas-XXXXXX")"
	(cd "$gen" && nice -n 19 go run . -in "$swagger" -out "$tmp")
	chmod 755 "$tmp"
	rm -rf "$dir"
	mv "$tmp" "$dir"
	touch "$dir/.complete-r$SCHEMA_GENERATOR_REVISION"
}

write_schema_generator() {
	local gen="$1"
	cat >"$gen/go.mod" <<'GOMOD'
module tessera.local/schemagen

go 1.22
GOMOD
	cat >"$gen/main.go" <<'GOSRC'
// schemagen converts a Kubernetes OpenAPI v2 document (swagger.json) into standalone JSON schemas,
// one per kind and API version, named as kubeconform's {{ .ResourceKind }}{{ .KindSuffix }}.json
// expects. Two trees are written: <out>/ (unknown fields allowed) and <out>/strict/ (every object
// with declared properties rejects unknown fields, like kubeconform -strict).
//
// Conversion rules, chosen to match what the API server accepts:
//   - every $ref is inlined; a reference cycle (only JSONSchemaProps in CRDs) becomes {} at the
//     point where it recurses;
//   - "format" is dropped (int32/int64/byte are not JSON Schema formats; date-time would reject
//     values the API server accepts);
//   - int-or-string becomes oneOf string|integer, resource.Quantity becomes oneOf string|number;
//   - optional properties also accept null, as the API server does;
//   - apiVersion and kind are pinned to the definition's group/version/kind.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

type gvk struct {
	Group   string `json:"group"`
	Version string `json:"version"`
	Kind    string `json:"kind"`
}

type converter struct {
	defs   map[string]any
	strict bool
}

func main() {
	in := flag.String("in", "", "swagger.json")
	out := flag.String("out", "", "output directory")
	flag.Parse()
	if err := run(*in, *out); err != nil {
		fmt.Fprintln(os.Stderr, "schemagen:", err)
		os.Exit(1)
	}
}

func run(in, out string) error {
	raw, err := os.ReadFile(in)
	if err != nil {
		return err
	}
	var doc struct {
		Definitions map[string]any `json:"definitions"`
	}
	if err := json.Unmarshal(raw, &doc); err != nil {
		return fmt.Errorf("%s: %w", in, err)
	}
	if len(doc.Definitions) == 0 {
		return fmt.Errorf("%s: no definitions", in)
	}
	names := make([]string, 0, len(doc.Definitions))
	for n := range doc.Definitions {
		names = append(names, n)
	}
	sort.Strings(names)
	written := 0
	for _, strict := range []bool{false, true} {
		dir := out
		if strict {
			dir = filepath.Join(out, "strict")
		}
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
		c := converter{defs: doc.Definitions, strict: strict}
		for _, name := range names {
			def, _ := doc.Definitions[name].(map[string]any)
			kinds := gvksOf(def)
			for _, k := range kinds {
				schema := c.convert(def, map[string]bool{name: true}, false)
				obj, ok := schema.(map[string]any)
				if !ok {
					continue
				}
				pinTypeMeta(obj, k)
				data, err := json.MarshalIndent(obj, "", "  ")
				if err != nil {
					return err
				}
				file := filepath.Join(dir, fileName(k))
				// Several definitions can claim the same kind (e.g. DeleteOptions is listed under
				// every group); the first one in sorted order wins, deterministically.
				if _, err := os.Stat(file); err == nil {
					continue
				}
				if err := os.WriteFile(file, data, 0o644); err != nil {
					return err
				}
				written++
			}
		}
	}
	if written == 0 {
		return fmt.Errorf("%s: no definition carries x-kubernetes-group-version-kind", in)
	}
	fmt.Fprintf(os.Stderr, "schemagen: wrote %d schemas\n", written)
	return nil
}

func gvksOf(def map[string]any) []gvk {
	raw, ok := def["x-kubernetes-group-version-kind"]
	if !ok {
		return nil
	}
	data, err := json.Marshal(raw)
	if err != nil {
		return nil
	}
	var out []gvk
	if json.Unmarshal(data, &out) != nil {
		return nil
	}
	return out
}

func apiVersion(k gvk) string {
	if k.Group == "" {
		return k.Version
	}
	return k.Group + "/" + k.Version
}

// fileName mirrors kubeconform's registry.schemaPath: kind lower-cased, then "-" + the first
// dot-separated part of the group (or the version for the core group), then "-" + version.
func fileName(k gvk) string {
	av := apiVersion(k)
	groupParts := strings.Split(av, "/")
	versionParts := strings.Split(groupParts[0], ".")
	suffix := "-" + strings.ToLower(versionParts[0])
	if len(groupParts) > 1 {
		suffix += "-" + strings.ToLower(groupParts[1])
	}
	return strings.ToLower(k.Kind) + suffix + ".json"
}

func pinTypeMeta(obj map[string]any, k gvk) {
	props, _ := obj["properties"].(map[string]any)
	if props == nil {
		return
	}
	props["apiVersion"] = map[string]any{"type": "string", "enum": []any{apiVersion(k)}}
	props["kind"] = map[string]any{"type": "string", "enum": []any{k.Kind}}
	req := map[string]bool{}
	if r, ok := obj["required"].([]any); ok {
		for _, v := range r {
			if s, ok := v.(string); ok {
				req[s] = true
			}
		}
	}
	req["apiVersion"], req["kind"] = true, true
	keys := make([]string, 0, len(req))
	for s := range req {
		keys = append(keys, s)
	}
	sort.Strings(keys)
	list := make([]any, len(keys))
	for i, s := range keys {
		list[i] = s
	}
	obj["required"] = list
}

// convert returns a deep copy of node with references inlined. stack holds the definitions being
// expanded on the current path, to cut cycles. nullable marks an optional property value.
func (c *converter) convert(node any, stack map[string]bool, nullable bool) any {
	switch n := node.(type) {
	case []any:
		out := make([]any, len(n))
		for i, v := range n {
			out[i] = c.convert(v, stack, false)
		}
		return out
	case map[string]any:
		if ref, ok := n["$ref"].(string); ok {
			name := strings.TrimPrefix(ref, "#/definitions/")
			if stack[name] {
				return map[string]any{}
			}
			def, ok := c.defs[name].(map[string]any)
			if !ok {
				return map[string]any{}
			}
			if special := specialDefinition(name); special != nil {
				return withNull(special, nullable)
			}
			stack[name] = true
			defer delete(stack, name)
			return c.convert(def, stack, nullable)
		}
		if f, _ := n["format"].(string); f == "int-or-string" {
			return withNull(map[string]any{"oneOf": []any{
				map[string]any{"type": "string"}, map[string]any{"type": "integer"},
			}}, nullable)
		}
		required := map[string]bool{}
		if r, ok := n["required"].([]any); ok {
			for _, v := range r {
				if s, ok := v.(string); ok {
					required[s] = true
				}
			}
		}
		out := map[string]any{}
		for k, v := range n {
			switch {
			case k == "format" || strings.HasPrefix(k, "x-kubernetes-"):
				continue
			case k == "properties":
				props, _ := v.(map[string]any)
				conv := map[string]any{}
				for pk, pv := range props {
					conv[pk] = c.convert(pv, stack, !required[pk])
				}
				out[k] = conv
			default:
				out[k] = c.convert(v, stack, false)
			}
		}
		if _, hasProps := out["properties"]; hasProps && c.strict {
			if _, set := out["additionalProperties"]; !set {
				out["additionalProperties"] = false
			}
		}
		return withNull(out, nullable)
	default:
		return n
	}
}

func specialDefinition(name string) map[string]any {
	switch name {
	case "io.k8s.apimachinery.pkg.api.resource.Quantity":
		return map[string]any{"oneOf": []any{map[string]any{"type": "string"}, map[string]any{"type": "number"}}}
	case "io.k8s.apimachinery.pkg.util.intstr.IntOrString":
		return map[string]any{"oneOf": []any{map[string]any{"type": "string"}, map[string]any{"type": "integer"}}}
	}
	return nil
}

// withNull lets an optional value be null, as the API server treats an explicit null like an
// omitted field.
func withNull(schema map[string]any, nullable bool) map[string]any {
	if !nullable {
		return schema
	}
	if t, ok := schema["type"].(string); ok {
		schema["type"] = []any{t, "null"}
		return schema
	}
	if one, ok := schema["oneOf"].([]any); ok {
		schema["oneOf"] = append(one, map[string]any{"type": "null"})
	}
	return schema
}
GOSRC
}

build_chartcheck() {
	local dir="$TOOLS/chartcheck-$K8S_SCHEMA_VERSION-r$CHARTCHECK_REVISION"
	if [[ -x "$dir/chartcheck" ]]; then
		return 0
	fi
	log "building chartcheck against k8s.io/apiserver and k8s.io/kube-scheduler $K8S_STAGING_VERSION (one-time cost)"
	local src
	src="$(mktemp -d "$TOOLS/.chartcheck-src-XXXXXX")"
	write_chartcheck "$src"
	# Only the direct requirements are pinned here; `go mod tidy` completes go.sum through the
	# proxy, checked against the checksum database like any module download.
	(cd "$src" && go mod tidy && nice -n 19 go build -trimpath -ldflags "-s -w" -o chartcheck .)
	mkdir -p "$dir"
	mv -f "$src/chartcheck" "$dir/chartcheck"
	rm -rf "$src"
}

write_chartcheck() {
	local src="$1"
	cat >"$src/go.mod" <<GOMOD
module tessera.local/chartcheck

go 1.24

require (
	k8s.io/api $K8S_STAGING_VERSION
	k8s.io/apimachinery $K8S_STAGING_VERSION
	k8s.io/apiserver $K8S_STAGING_VERSION
	k8s.io/kube-scheduler $K8S_STAGING_VERSION
	sigs.k8s.io/yaml v1.6.0
)
GOMOD
	cat >"$src/main.go" <<'GOSRC'
// chartcheck checks two things the Kubernetes OpenAPI schemas cannot:
//
//	chartcheck scheduler-config FILE
//	    FILE must decode strictly (no unknown or mistyped field) into kube-scheduler's
//	    KubeSchedulerConfiguration v1 and satisfy the extender rules kube-scheduler enforces.
//	chartcheck webhook-match -resources a,b -trusted u1,u2 [-gpu-only] FILE
//	    every matchConditions expression of every MutatingWebhookConfiguration in FILE is
//	    compiled and evaluated by the API server's own matcher (k8s.io/apiserver) on sample
//	    requests; each must give the expected answer and none may error (an error under
//	    failurePolicy Fail refuses the pod).
package main

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"os"
	"regexp"
	"strings"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/admission"
	"k8s.io/apiserver/pkg/admission/plugin/cel"
	"k8s.io/apiserver/pkg/admission/plugin/webhook/matchconditions"
	"k8s.io/apiserver/pkg/authentication/user"
	"k8s.io/apiserver/pkg/authorization/authorizerfactory"
	"k8s.io/apiserver/pkg/cel/environment"
	schedv1 "k8s.io/kube-scheduler/config/v1"
	"sigs.k8s.io/yaml"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: chartcheck scheduler-config FILE | webhook-match [flags] FILE")
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "scheduler-config":
		if len(os.Args) != 3 {
			err = fmt.Errorf("usage: chartcheck scheduler-config FILE")
		} else {
			err = schedulerConfig(os.Args[2])
		}
	case "webhook-match":
		err = webhookMatch(os.Args[2:])
	default:
		err = fmt.Errorf("unknown command %q", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "chartcheck:", err)
		os.Exit(1)
	}
}

var resourceNameRE = regexp.MustCompile(`^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*)/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$`)

func schedulerConfig(path string) error {
	raw, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	var cfg schedv1.KubeSchedulerConfiguration
	if err := yaml.UnmarshalStrict(raw, &cfg); err != nil {
		return fmt.Errorf("%s: not a valid KubeSchedulerConfiguration: %w", path, err)
	}
	var problems []string
	if cfg.APIVersion != "kubescheduler.config.k8s.io/v1" || cfg.Kind != "KubeSchedulerConfiguration" {
		problems = append(problems, fmt.Sprintf("apiVersion/kind %s/%s", cfg.APIVersion, cfg.Kind))
	}
	if len(cfg.Profiles) == 0 {
		problems = append(problems, "no profiles")
	}
	for i, p := range cfg.Profiles {
		if p.SchedulerName == nil || *p.SchedulerName == "" {
			problems = append(problems, fmt.Sprintf("profiles[%d]: empty schedulerName", i))
		}
	}
	binders := 0
	seen := map[string]bool{}
	for i, e := range cfg.Extenders {
		if e.URLPrefix == "" {
			problems = append(problems, fmt.Sprintf("extenders[%d]: empty urlPrefix", i))
		}
		if e.BindVerb != "" {
			binders++
		}
		if e.PrioritizeVerb != "" && e.Weight <= 0 {
			problems = append(problems, fmt.Sprintf("extenders[%d]: weight must be positive with prioritizeVerb", i))
		}
		if e.EnableHTTPS != strings.HasPrefix(e.URLPrefix, "https://") {
			problems = append(problems, fmt.Sprintf("extenders[%d]: enableHTTPS=%v but urlPrefix %q", i, e.EnableHTTPS, e.URLPrefix))
		}
		if e.TLSConfig != nil && (e.TLSConfig.CertFile == "") != (e.TLSConfig.KeyFile == "") {
			problems = append(problems, fmt.Sprintf("extenders[%d]: certFile and keyFile go together", i))
		}
		for _, r := range e.ManagedResources {
			if !resourceNameRE.MatchString(r.Name) {
				problems = append(problems, fmt.Sprintf("extenders[%d]: managed resource %q is not an extended resource name", i, r.Name))
			}
			if seen[r.Name] {
				problems = append(problems, fmt.Sprintf("extenders[%d]: managed resource %q listed twice", i, r.Name))
			}
			seen[r.Name] = true
		}
	}
	if binders > 1 {
		problems = append(problems, "more than one extender has a bindVerb")
	}
	if len(problems) > 0 {
		return fmt.Errorf("%s: %s", path, strings.Join(problems, "; "))
	}
	fmt.Printf("%s: valid KubeSchedulerConfiguration v1 (%d profile(s), %d extender(s))\n", path, len(cfg.Profiles), len(cfg.Extenders))
	return nil
}

type sample struct {
	name      string
	op        admission.Operation
	user      string
	pod       *corev1.Pod
	wantMatch bool
}

func webhookMatch(args []string) error {
	fs := flag.NewFlagSet("webhook-match", flag.ContinueOnError)
	resources := fs.String("resources", "", "the chart's resource names, comma-separated (count name first)")
	trusted := fs.String("trusted", "", "usernames the webhook must never see, comma-separated")
	gpuOnly := fs.Bool("gpu-only", true, "only GPU pods and pods with hami.io/ metadata must match")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() != 1 || *resources == "" || *trusted == "" {
		return fmt.Errorf("usage: chartcheck webhook-match -resources a,b -trusted u1,u2 [-gpu-only=false] FILE")
	}
	raw, err := os.ReadFile(fs.Arg(0))
	if err != nil {
		return err
	}
	var hooks []admissionregistrationv1.MutatingWebhook
	for _, doc := range bytes.Split(raw, []byte("\n---")) {
		var meta metav1.TypeMeta
		if yaml.Unmarshal(doc, &meta) != nil || meta.Kind != "MutatingWebhookConfiguration" {
			continue
		}
		var mwc admissionregistrationv1.MutatingWebhookConfiguration
		if err := yaml.UnmarshalStrict(doc, &mwc); err != nil {
			return fmt.Errorf("MutatingWebhookConfiguration: %w", err)
		}
		hooks = append(hooks, mwc.Webhooks...)
	}
	if len(hooks) == 0 {
		return fmt.Errorf("%s: no MutatingWebhookConfiguration", fs.Arg(0))
	}

	names := strings.Split(*resources, ",")
	users := strings.Split(*trusted, ",")
	const someone = "alice@example.com"
	samples := []sample{
		{"GPU count in limits", admission.Create, someone, pod(limits(names[0], "1")), true},
		{"memory only, in requests", admission.Create, someone, pod(requests(names[len(names)-1], "1")), true},
		{"GPU resource in an init container", admission.Create, someone, withInit(pod(nil), limits(names[0], "1")), true},
		{"GPU pod updated by a user", admission.Update, someone, pod(limits(names[0], "1")), true},
		{"forged allocation annotation", admission.Create, someone, annotated(pod(nil), "hami.io/vgpu-devices-allocated", "GPU-0,NVIDIA,1000,10:;"), true},
		{"forged vgpu-node label", admission.Update, someone, labelled(pod(nil), "hami.io/vgpu-node", "node-a"), true},
		{"plain pod", admission.Create, someone, pod(limits("cpu", "1")), !*gpuOnly},
		{"pod without resources", admission.Create, someone, pod(nil), !*gpuOnly},
		{"only the hami.io/webhook label", admission.Create, someone, labelled(pod(nil), "hami.io/webhook", "ignore"), !*gpuOnly},
	}
	for _, u := range users {
		samples = append(samples,
			sample{"GPU pod patched by " + u, admission.Update, u, annotated(pod(limits(names[0], "1")), "hami.io/bind-phase", "allocating"), false})
	}

	compiler := cel.NewConditionCompiler(environment.MustBaseEnvSet(environment.DefaultCompatibilityVersion(), true))
	authz := authorizerfactory.NewAlwaysAllowAuthorizer()
	failures := 0
	for _, hook := range hooks {
		exprs := make([]cel.ExpressionAccessor, len(hook.MatchConditions))
		for i, mc := range hook.MatchConditions {
			exprs[i] = &matchconditions.MatchCondition{Name: mc.Name, Expression: mc.Expression}
		}
		matcher := matchconditions.NewMatcher(compiler.CompileCondition(exprs,
			cel.OptionalVariableDeclarations{HasParams: false, HasAuthorizer: true, StrictCost: true},
			environment.NewExpressions), hook.FailurePolicy, "webhook", "admit", hook.Name)
		for _, s := range samples {
			res := matcher.Match(context.Background(), attributes(s), nil, authz)
			switch {
			case res.Error != nil:
				failures++
				fmt.Printf("FAIL %s: %s: evaluation error (the pod would be refused): %v\n", hook.Name, s.name, res.Error)
			case res.Matches != s.wantMatch:
				failures++
				fmt.Printf("FAIL %s: %s: matched=%v, want %v (condition %q)\n", hook.Name, s.name, res.Matches, s.wantMatch, res.FailedConditionName)
			default:
				fmt.Printf("ok   %s: %s: matched=%v\n", hook.Name, s.name, res.Matches)
			}
		}
	}
	if failures > 0 {
		return fmt.Errorf("%d match-condition check(s) failed", failures)
	}
	return nil
}

func limits(name, q string) *corev1.ResourceRequirements {
	return &corev1.ResourceRequirements{Limits: corev1.ResourceList{corev1.ResourceName(name): resource.MustParse(q)}}
}

func requests(name, q string) *corev1.ResourceRequirements {
	return &corev1.ResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceName(name): resource.MustParse(q)}}
}

func pod(res *corev1.ResourceRequirements) *corev1.Pod {
	c := corev1.Container{Name: "main", Image: "example"}
	if res != nil {
		c.Resources = *res
	}
	return &corev1.Pod{
		TypeMeta:   metav1.TypeMeta{APIVersion: "v1", Kind: "Pod"},
		ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: "team-a"},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{c}},
	}
}

func withInit(p *corev1.Pod, res *corev1.ResourceRequirements) *corev1.Pod {
	p.Spec.InitContainers = []corev1.Container{{Name: "init", Image: "example", Resources: *res}}
	return p
}

func annotated(p *corev1.Pod, k, v string) *corev1.Pod {
	p.Annotations = map[string]string{k: v}
	return p
}

func labelled(p *corev1.Pod, k, v string) *corev1.Pod {
	p.Labels = map[string]string{k: v}
	return p
}

func attributes(s sample) *admission.VersionedAttributes {
	gvk := schema.GroupVersionKind{Version: "v1", Kind: "Pod"}
	gvr := schema.GroupVersionResource{Version: "v1", Resource: "pods"}
	var old runtime.Object
	var opts runtime.Object = &metav1.CreateOptions{}
	if s.op == admission.Update {
		old = s.pod.DeepCopy()
		opts = &metav1.UpdateOptions{}
	}
	a := admission.NewAttributesRecord(s.pod, old, gvk, s.pod.Namespace, s.pod.Name, gvr, "", s.op, opts, false, &user.DefaultInfo{Name: s.user})
	return &admission.VersionedAttributes{Attributes: a, VersionedObject: s.pod, VersionedOldObject: old, VersionedKind: gvk}
}
GOSRC
}

mkdir -p "$TOOLS"
go_install helm helm.sh/helm/v3/cmd/helm "$HELM_VERSION" "$(printf -- '-X %s ' \
	"helm.sh/helm/v3/internal/version.version=$HELM_VERSION" \
	"helm.sh/helm/v3/internal/version.gitTreeState=clean" \
	"helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1" \
	"helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$HELM_K8S_MINOR" \
	"helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1" \
	"helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$HELM_K8S_MINOR")"
go_install kubeconform github.com/yannh/kubeconform/cmd/kubeconform "$KUBECONFORM_VERSION" \
	"-X main.version=$KUBECONFORM_VERSION"
go_install promtool github.com/prometheus/prometheus/cmd/promtool "$PROMTOOL_VERSION"
# The Prometheus server of the same release, for the real-node test that scrapes the daemons and
# evaluates every dashboard query and alert expression (no UI assets: the HTTP API is enough).
go_install prometheus github.com/prometheus/prometheus/cmd/prometheus "$PROMTOOL_VERSION"
go_install actionlint github.com/rhysd/actionlint/cmd/actionlint "$ACTIONLINT_VERSION" \
	"-X github.com/rhysd/actionlint.version=$ACTIONLINT_VERSION"
# Kueue's manager and its chart (`charts/kueue` of the module, which the proxy serves whole).
go_install kueue sigs.k8s.io/kueue/cmd/kueue "$KUEUE_VERSION"
kueue_chart() {
	local dir="$TOOLS/kueue-$KUEUE_VERSION/chart"
	if [[ -f "$dir/kueue/Chart.yaml" ]]; then
		return 0
	fi
	local module_dir tmp
	module_dir="$(cd "$TOOLS" && go mod download -json "sigs.k8s.io/kueue@$KUEUE_VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
	[[ -f "$module_dir/charts/kueue/Chart.yaml" ]] || { log "error: no charts/kueue in sigs.k8s.io/kueue@$KUEUE_VERSION"; exit 1; }
	tmp="$(mktemp -d "$TOOLS/.kueue-chart-XXXXXX")"
	cp -r "$module_dir/charts/kueue" "$tmp/kueue"
	chmod -R u+w "$tmp"
	rm -rf "$dir"
	mv "$tmp" "$dir"
}
kueue_chart
go_install krew sigs.k8s.io/krew/cmd/krew "$KREW_VERSION"
generate_schemas
build_chartcheck

echo "HELM=$TOOLS/helm-$HELM_VERSION/helm"
echo "KUBECONFORM=$TOOLS/kubeconform-$KUBECONFORM_VERSION/kubeconform"
echo "K8S_SCHEMA_DIR=$TOOLS/k8s-schemas-$K8S_SCHEMA_VERSION"
echo "K8S_SCHEMA_VERSION=${K8S_SCHEMA_VERSION#v}"
echo "CHARTCHECK=$TOOLS/chartcheck-$K8S_SCHEMA_VERSION-r$CHARTCHECK_REVISION/chartcheck"
echo "PROMTOOL=$TOOLS/promtool-$PROMTOOL_VERSION/promtool"
echo "PROMETHEUS=$TOOLS/prometheus-$PROMTOOL_VERSION/prometheus"
echo "ACTIONLINT=$TOOLS/actionlint-$ACTIONLINT_VERSION/actionlint"
echo "KUEUE=$TOOLS/kueue-$KUEUE_VERSION/kueue"
echo "KUEUE_CHART=$TOOLS/kueue-$KUEUE_VERSION/chart/kueue"
echo "KUEUE_VERSION=$KUEUE_VERSION"
echo "KREW=$TOOLS/krew-$KREW_VERSION/krew"
