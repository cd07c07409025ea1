#!/usr/bin/env bash
# Builds the pinned chart tooling (helm, kubeconform) with `go install` and generates the
# Kubernetes JSON schemas kubeconform validates against, all offline except for the Go module
# proxy. Everything lands in a cache keyed by version, so a second run only checks that the
# files are there:
#
#   ${TESSERA_CACHE:-$HOME/.cache/tessera}/tools/helm-<v>/helm
#   ${TESSERA_CACHE:-$HOME/.cache/tessera}/tools/kubeconform-<v>/kubeconform
#   ${TESSERA_CACHE:-$HOME/.cache/tessera}/tools/k8s-schemas-<v>/{<kind>-<group>-<version>.json, strict/...}
#
# Prints `NAME=PATH` lines on stdout (eval-able); progress goes to stderr.
#
# Why schemas are generated here: kubeconform downloads its schemas from GitHub by default, which
# is not reachable. The authoritative OpenAPI v2 document of a Kubernetes release,
# `api/openapi-spec/swagger.json`, ships inside the Go module `k8s.io/kubernetes@<release>`, which
# the module proxy serves. The small generator embedded below turns every definition that carries
# `x-kubernetes-group-version-kind` into one standalone JSON schema per kind (all `$ref`s inlined),
# the same layout as yannh/kubernetes-json-schema's `-standalone` and `-standalone-strict` trees.
set -euo pipefail

HELM_VERSION="${TESSERA_HELM_VERSION:-v3.19.5}"
KUBECONFORM_VERSION="${TESSERA_KUBECONFORM_VERSION:-v0.7.0}"
# The Kubernetes release whose API the chart is validated against (kubeconform -kubernetes-version).
K8S_SCHEMA_VERSION="${TESSERA_K8S_SCHEMA_VERSION:-v1.34.4}"
# Bump when the generator below changes, so stale schemas are never reused.
SCHEMA_GENERATOR_REVISION=1

CACHE="${TESSERA_CACHE:-$HOME/.cache/tessera}"
TOOLS="$CACHE/tools"

log() { printf 'tools.sh: %s\n' "$*" >&2; }

command -v go >/dev/null 2>&1 || { log "error: the Go toolchain is required (go install builds helm and kubeconform)"; exit 1; }
# Never let `go` fetch a different toolchain behind our back; fail loudly instead.
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
export CGO_ENABLED=0

# go_install NAME PACKAGE VERSION: installs PACKAGE@VERSION into $TOOLS/NAME-VERSION/ unless the
# binary is already there. The build goes to a temporary GOBIN and is moved in place only when it
# succeeded, so an interrupted build never leaves a half-written binary that a later run trusts.
go_install() {
	local name="$1" pkg="$2" version="$3"
	local dir="$TOOLS/$name-$version"
	if [[ -x "$dir/$name" ]]; then
		return 0
	fi
	log "building $name $version (go install $pkg@$version; one-time cost)"
	local tmp
	tmp="$(mktemp -d "$TOOLS/.build-$name-XXXXXX")"
	GOBIN="$tmp" nice -n 19 go install -trimpath "$pkg@$version"
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

mkdir -p "$TOOLS"
go_install helm helm.sh/helm/v3/cmd/helm "$HELM_VERSION"
go_install kubeconform github.com/yannh/kubeconform/cmd/kubeconform "$KUBECONFORM_VERSION"
generate_schemas

echo "HELM=$TOOLS/helm-$HELM_VERSION/helm"
echo "KUBECONFORM=$TOOLS/kubeconform-$KUBECONFORM_VERSION/kubeconform"
echo "K8S_SCHEMA_DIR=$TOOLS/k8s-schemas-$K8S_SCHEMA_VERSION"
echo "K8S_SCHEMA_VERSION=${K8S_SCHEMA_VERSION#v}"
