{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "tessera.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Release-scoped base name: the release name alone when it already contains the chart name. */}}
{{- define "tessera.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The namespace of every namespaced object: HAMi's namespaceOverride, else the release's. */}}
{{- define "tessera.namespace" -}}
{{- .Values.namespaceOverride | default .Release.Namespace -}}
{{- end -}}

{{- define "tessera.scheduler" -}}{{ include "tessera.fullname" . | trunc 53 | trimSuffix "-" }}-scheduler{{- end -}}
{{- define "tessera.devicePlugin" -}}{{ include "tessera.fullname" . | trunc 49 | trimSuffix "-" }}-device-plugin{{- end -}}
{{- define "tessera.draPlugin" -}}{{ include "tessera.fullname" . | trunc 52 | trimSuffix "-" }}-dra-plugin{{- end -}}
{{- define "tessera.webhook" -}}{{ include "tessera.fullname" . | trunc 55 | trimSuffix "-" }}-webhook{{- end -}}
{{/* Secret with the webhook/extender serving certificate (keys tls.crt, tls.key, ca.crt). */}}
{{- define "tessera.servingSecret" -}}{{ include "tessera.scheduler" . }}-tls{{- end -}}
{{/* Secret with kube-scheduler's client certificate for /filter and /bind, and its CA. */}}
{{- define "tessera.clientSecret" -}}{{ include "tessera.scheduler" . }}-extender-client{{- end -}}
{{/* Lease names: kube-scheduler and tessera-scheduler elect separately. */}}
{{- define "tessera.kubeSchedulerLease" -}}{{ include "tessera.fullname" . | trunc 46 | trimSuffix "-" }}-kube-scheduler{{- end -}}
{{- define "tessera.extenderLease" -}}{{ include "tessera.scheduler" . }}-extender{{- end -}}
{{/*
  kube-scheduler's own ServiceAccount, apart from the extender's (the pod's): the network-facing
  extender must not hold kube-scheduler's rights (delete any pod, write any ResourceClaim's status).
*/}}
{{- define "tessera.kubeScheduler" -}}{{ include "tessera.kubeSchedulerLease" . }}{{- end -}}
{{- define "tessera.kubeSchedulerToken" -}}{{ include "tessera.kubeScheduler" . }}-token{{- end -}}

{{- define "tessera.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "tessera.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.global.labels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "tessera.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tessera.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tessera.annotations" -}}
{{- with .Values.global.annotations }}
annotations:
{{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* imageRef (list REGISTRY REPOSITORY TAG): <registry>/<repository>:<tag>, or
     <repository>:<tag> without a registry. */}}
{{- define "tessera.imageRef" -}}
{{- $registry := index . 0 | default "" | toString | trimSuffix "/" -}}
{{- $repository := index . 1 | toString -}}
{{- $tag := index . 2 | toString -}}
{{- if $registry -}}
{{- printf "%s/%s:%s" $registry $repository $tag -}}
{{- else -}}
{{- printf "%s:%s" $repository $tag -}}
{{- end -}}
{{- end -}}

{{/* True when a tag is a HAMi release tag (`v2.10.0`): HAMi tags its releases v<x>.<y>.<z>,
     Tessera tags its images with the bare appVersion (`0.1.0`), never with a leading `v`. */}}
{{- define "tessera.isHamiReleaseTag" -}}
{{- if regexMatch "^v[0-9]+\\.[0-9]+\\.[0-9]+" (toString .) }}true{{ end -}}
{{- end -}}

{{/* tesseraImage (list ROOT IMAGE DEFAULT_REPOSITORY): a Tessera daemon's image.
     - An image naming HAMi's repository (`projecthami/hami`, as in HAMi's values file) is
       replaced by Tessera's own: registry ghcr.io, DEFAULT_REPOSITORY, the chart's appVersion.
     - global.imageRegistry replaces the registry (a mirror), for HAMi's images too.
     - An empty tag takes global.imageTag, unless that is a HAMi release tag (`v2.10.0`, see
       tessera.isHamiReleaseTag), then the chart's appVersion.
     - A digest (`sha256:…`, a release's values-digests.yaml) pins the image: <ref>@<digest>. */}}
{{- define "tessera.tesseraImage" -}}
{{- $root := index . 0 -}}
{{- $img := index . 1 | default dict -}}
{{- $defaultRepository := index . 2 -}}
{{- $registry := $img.registry | default "" | toString -}}
{{- $repository := $img.repository | default $defaultRepository | toString -}}
{{- $tag := $img.tag | default "" | toString -}}
{{- if regexMatch "(^|/)projecthami/hami$" $repository -}}
{{- /* HAMi's registry (Docker Hub) has no Tessera image; a mirror the user named is kept. */ -}}
{{- if has (trimSuffix "/" $registry) (list "" "docker.io" "index.docker.io" "registry-1.docker.io") -}}
{{- $registry = "ghcr.io" -}}
{{- end -}}
{{- $repository = $defaultRepository -}}
{{- $tag = "" -}}
{{- end -}}
{{- if not $tag -}}
{{- $global := $root.Values.global.imageTag | default "" | toString -}}
{{- if and $global (not (include "tessera.isHamiReleaseTag" $global)) -}}
{{- $tag = $global -}}
{{- else -}}
{{- $tag = $root.Chart.AppVersion -}}
{{- end -}}
{{- end -}}
{{- include "tessera.imageRef" (list ($root.Values.global.imageRegistry | default $registry) $repository $tag) -}}
{{- with $img.digest }}@{{ . }}{{ end -}}
{{- end -}}

{{/* The Kubernetes version the chart renders for, without a distribution suffix
     (v1.31.1+k3s1 -> v1.31.1), as HAMi strips it. */}}
{{- define "tessera.kubeVersion" -}}
{{- regexReplaceAll "^(v[0-9]+\\.[0-9]+\\.[0-9]+)(.*)$" .Capabilities.KubeVersion.Version "${1}" -}}
{{- end -}}

{{/* True on Kubernetes >= 1.22 (HAMi's switch from extraArgs to extraNewArgs). Minor versions
     like "22+" (GKE, EKS) are read as 22. */}}
{{- define "tessera.kubeAtLeast122" -}}
{{- $major := regexReplaceAll "[^0-9]" (toString .Capabilities.KubeVersion.Major) "" | int -}}
{{- $minor := regexReplaceAll "[^0-9]" (toString .Capabilities.KubeVersion.Minor) "" | int -}}
{{- if or (gt $major 1) (and (eq $major 1) (ge $minor 22)) }}true{{ end -}}
{{- end -}}

{{/* kube-scheduler's image: tag "" = the cluster's own version (as HAMi); global.imageTag
     never applies (it names Tessera's or HAMi's release, not Kubernetes'). */}}
{{- define "tessera.kubeSchedulerImage" -}}
{{- $img := .Values.scheduler.kubeScheduler.image -}}
{{- $tag := $img.tag | default "" | toString | trim | default (include "tessera.kubeVersion" .) -}}
{{- include "tessera.imageRef" (list (.Values.global.imageRegistry | default $img.registry) $img.repository $tag) -}}
{{- end -}}

{{/* kube-scheduler's arguments after the chart's own --config: extraNewArgs on Kubernetes
     >= 1.22, extraArgs before (HAMi's rule). A --config flag among them is dropped: the chart's
     KubeSchedulerConfiguration is the one kube-scheduler must read (HAMi's default
     extraNewArgs carry --config=/config/config.yaml, the same file). */}}
{{- define "tessera.kubeSchedulerArgs" -}}
{{- $args := .Values.scheduler.kubeScheduler.extraArgs -}}
{{- if include "tessera.kubeAtLeast122" . -}}
{{- $args = .Values.scheduler.kubeScheduler.extraNewArgs -}}
{{- end -}}
{{- $out := list -}}
{{- range $args | default list -}}
{{- if not (regexMatch "^--?config(=|$)" (toString .)) -}}
{{- $out = append $out (toString .) -}}
{{- end -}}
{{- end -}}
{{- if $out }}{{ toYaml $out }}{{ end -}}
{{- end -}}

{{/* The webhook/extender serving certificate (tls.crt, tls.key, ca.crt, base64), issued by Helm
     when cert-manager is off: kept across upgrades (lookup) while the Secret holds all three
     keys for the same names, generated otherwise. Memoised in .Values for the render, so the
     Secret, the webhook's caBundle and the Deployment's checksum see the same certificate.
     Returns JSON (fromJson at the call site). */}}
{{- define "tessera.servingCert" -}}
{{- /* Refuse impossible values before spending time on key generation. */ -}}
{{- include "tessera.validate" . -}}
{{- $memo := "__tesseraServingCert" -}}
{{- if not (hasKey .Values $memo) -}}
{{- $svc := include "tessera.scheduler" . -}}
{{- $dns := list $svc (printf "%s.%s" $svc (include "tessera.namespace" .)) (printf "%s.%s.svc" $svc (include "tessera.namespace" .)) (printf "%s.%s.svc.cluster.local" $svc (include "tessera.namespace" .)) -}}
{{- $ips := list -}}
{{- $url := .Values.scheduler.admissionWebhook.customURL -}}
{{- if $url.enabled -}}
{{- if regexMatch "^[0-9.]+$|:" (toString $url.host) -}}
{{- $ips = append $ips (toString $url.host) -}}
{{- else -}}
{{- $dns = append $dns (toString $url.host) -}}
{{- end -}}
{{- end -}}
{{- $names := concat $dns $ips | join "," -}}
{{- $existing := lookup "v1" "Secret" (include "tessera.namespace" .) (include "tessera.servingSecret" .) -}}
{{- $data := dict -}}
{{- $existingData := dig "data" dict ($existing | default dict) -}}
{{- $existingNames := dig "metadata" "annotations" "tessera.io/serving-names" "" ($existing | default dict) -}}
{{- if and (hasKey $existingData "tls.crt") (hasKey $existingData "tls.key") (hasKey $existingData "ca.crt") (eq $existingNames $names) -}}
{{- $data = dict "tls.crt" (index $existingData "tls.crt") "tls.key" (index $existingData "tls.key") "ca.crt" (index $existingData "ca.crt") -}}
{{- else -}}
{{- $ca := genCA (printf "%s webhook CA" (include "tessera.fullname" .)) 3650 -}}
{{- $cert := genSignedCert $svc $ips $dns 3650 $ca -}}
{{- $data = dict "tls.crt" ($cert.Cert | b64enc) "tls.key" ($cert.Key | b64enc) "ca.crt" ($ca.Cert | b64enc) -}}
{{- end -}}
{{- $_ := set $data "names" $names -}}
{{- $_ := set .Values $memo $data -}}
{{- end -}}
{{- index .Values $memo | toJson -}}
{{- end -}}

{{/* True when the chart issues the serving certificate itself (HTTPS, patch on, no cert-manager). */}}
{{- define "tessera.helmServingCert" -}}
{{- if and .Values.scheduler.enableHTTPS .Values.scheduler.patch.enabled (not .Values.scheduler.certManager.enabled) }}true{{ end -}}
{{- end -}}

{{/* imagePullSecrets (list ROOT IMAGE...): global.imagePullSecrets plus each image's own
     pullSecrets (HAMi's per-image key), deduplicated; names or {name: ...} objects. */}}
{{- define "tessera.imagePullSecrets" -}}
{{- $root := index . 0 -}}
{{- $names := list -}}
{{- $all := $root.Values.global.imagePullSecrets | default list -}}
{{- range rest . -}}
{{- $all = concat $all ((. | default dict).pullSecrets | default list) -}}
{{- end -}}
{{- range $all -}}
{{- $name := "" -}}
{{- if kindIs "map" . -}}{{- $name = get . "name" | default "" | toString -}}{{- else if . -}}{{- $name = toString . -}}{{- end -}}
{{- if and $name (not (has $name $names)) -}}
{{- $names = append $names $name -}}
{{- end -}}
{{- end -}}
{{- with $names }}
imagePullSecrets:
{{- range . }}
  - name: {{ . }}
{{- end }}
{{- end }}
{{- end -}}

{{/* True when the extender listener serves TLS. */}}
{{- define "tessera.https" -}}
{{- if .Values.scheduler.enableHTTPS }}true{{ end -}}
{{- end -}}

{{/* Validates combinations that cannot work, with an explanation instead of a broken install. */}}
{{- define "tessera.validate" -}}
{{- if and .Values.scheduler.admissionWebhook.enabled (not .Values.scheduler.enableHTTPS) -}}
{{- fail "scheduler.admissionWebhook.enabled requires scheduler.enableHTTPS: the API server only calls webhooks over HTTPS. Disable the webhook for an HTTP-only extender." -}}
{{- end -}}
{{- if and .Values.scheduler.extenderClientAuth (not .Values.scheduler.enableHTTPS) -}}
{{- fail "scheduler.extenderClientAuth (mutual TLS on /filter and /bind) requires scheduler.enableHTTPS. With enableHTTPS: false set extenderClientAuth: false; the extender then listens on 127.0.0.1 only." -}}
{{- end -}}
{{- if and .Values.scheduler.enableHTTPS (not .Values.scheduler.certManager.enabled) (not .Values.scheduler.patch.enabled) -}}
{{- fail "scheduler.patch.enabled: false (HAMi: no certificate Job, a Secret made by hand) is not supported: scheduler.enableHTTPS needs a certificate source. Keep scheduler.patch.enabled: true (Helm issues the certificate) or set scheduler.certManager.enabled: true." -}}
{{- end -}}
{{- if lt (int .Values.scheduler.replicas) 1 -}}
{{- fail "scheduler.replicas must be at least 1" -}}
{{- end -}}
{{- if and (gt (int .Values.scheduler.replicas) 1) (not .Values.scheduler.leaderElect) -}}
{{- fail "scheduler.replicas > 1 requires scheduler.leaderElect: several kube-schedulers would bind the same pods." -}}
{{- end -}}
{{- if ne (trimSuffix "/" (toString .Values.devicePlugin.libPath)) "/usr/local/vgpu" -}}
{{- fail (printf "devicePlugin.libPath is %q, but Tessera mounts the shim at /usr/local/vgpu in every container (global.gpuHookPath moves only the host directory): ld.so.preload would name a path where nothing is mounted and the GPU limits would be silently dropped. Remove devicePlugin.libPath or set it to /usr/local/vgpu." (toString .Values.devicePlugin.libPath)) -}}
{{- end -}}
{{- include "tessera.validateHamiKeys" . -}}
{{- $names := list .Values.resourceName .Values.resourceMem .Values.resourceMemPercentage .Values.resourceCores .Values.resourcePriority -}}
{{- range $names -}}
{{- if not (regexMatch "^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*)/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$" .) -}}
{{- fail (printf "resource name %q is not a valid extended resource name (domain/name)" .) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The service account usernames of the chart's own components (trusted by the webhook). */}}
{{- define "tessera.trustedUsers" -}}
{{- printf "system:serviceaccount:%s:%s,system:serviceaccount:%s:%s" (include "tessera.namespace" .) (include "tessera.scheduler" .) (include "tessera.namespace" .) (include "tessera.devicePlugin" .) -}}
{{- /* The admission policy's extra identities are trusted by the webhook too, so the two
       never disagree (a mixed cluster's HAMi plugin must pass both). */ -}}
{{- range (.Values.admissionPolicy | default dict).additionalTrustedUsers | default list -}}
{{- printf ",%s" . -}}
{{- end -}}
{{- end -}}

{{/* HAMi v2.10 values keys that Tessera cannot honour (charts/tessera/files/hami-v2.10-keys.yaml,
     disposition `refused`): a value other than the listed `allowed` ones (HAMi's default) fails
     the install, naming the key and what to use instead. Keys refused only when they contradict
     another value are checked after the loop. */}}
{{- define "tessera.validateHamiKeys" -}}
{{- $inventory := .Files.Get "files/hami-v2.10-keys.yaml" | fromYaml -}}
{{- if not $inventory.keys -}}
{{- fail "files/hami-v2.10-keys.yaml is missing from the chart" -}}
{{- end -}}
{{- range $key, $entry := $inventory.keys -}}
{{- if and (eq (toString $entry.disposition) "refused") (hasKey $entry "allowed") -}}
{{- $value := $.Values -}}
{{- $found := true -}}
{{- range splitList "." $key -}}
{{- if and $found (kindIs "map" $value) (hasKey $value .) -}}
{{- $value = index $value . -}}
{{- else -}}
{{- $found = false -}}
{{- end -}}
{{- end -}}
{{- if $found -}}
{{- $ok := false -}}
{{- range $entry.allowed -}}
{{- if eq (toJson .) (toJson $value) -}}{{- $ok = true -}}{{- end -}}
{{- end -}}
{{- if not $ok -}}
{{- fail (printf "%s: %s is not supported by Tessera (HAMi's default %s is accepted). %s" $key (toJson $value) (first $entry.allowed | toJson) $entry.instead) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $svc := .Values.scheduler.service -}}
{{- $metricsPort := last (splitList ":" (toString .Values.scheduler.metricsBindAddress)) | int -}}
{{- if and (hasKey $svc "monitorTargetPort") (ne (int $svc.monitorTargetPort) $metricsPort) -}}
{{- fail (printf "scheduler.service.monitorTargetPort: %v is not the extender's metrics port (%d, from scheduler.metricsBindAddress): the Service always targets that port. Remove monitorTargetPort and set scheduler.metricsBindAddress to move it." $svc.monitorTargetPort $metricsPort) -}}
{{- end -}}
{{- if and (hasKey $svc "httpTargetPort") (ne (int $svc.httpTargetPort) (int .Values.scheduler.httpsPort)) -}}
{{- fail (printf "scheduler.service.httpTargetPort: %v is not the extender's listening port (%v, scheduler.httpsPort): the Service always targets that port. Remove httpTargetPort and set scheduler.httpsPort to move it." $svc.httpTargetPort .Values.scheduler.httpsPort) -}}
{{- end -}}
{{- $ctrPath := dig "monitor" "ctrPath" "" .Values.devicePlugin | toString | trimSuffix "/" -}}
{{- $hookCtrs := printf "%s/vgpu/containers" (trimSuffix "/" (toString .Values.global.gpuHookPath)) -}}
{{- if and $ctrPath (ne $ctrPath $hookCtrs) (ne $ctrPath "/usr/local/vgpu/containers") -}}
{{- fail (printf "devicePlugin.monitor.ctrPath: %q is not %s: Tessera's monitor (part of the device plugin) always reads the containers directory under global.gpuHookPath. Remove ctrPath, or move global.gpuHookPath." $ctrPath $hookCtrs) -}}
{{- end -}}
{{- /* NodePort: HAMi's meaning, the node ports are the values below (30000-32767). */ -}}
{{- if eq (toString $svc.type) "NodePort" -}}
{{- range $k := list "schedulerPort" "monitorPort" -}}
{{- $p := index $svc $k | default 0 | int -}}
{{- if and (hasKey $svc $k) (or (lt $p 30000) (gt $p 32767)) -}}
{{- fail (printf "scheduler.service.%s: %v is not a node port (30000-32767); with scheduler.service.type NodePort it is the Service's nodePort, as in HAMi. Choose a port in that range, or type ClusterIP." $k (index $svc $k)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $dps := .Values.devicePlugin.service -}}
{{- if and .Values.devicePlugin.enabled (eq (toString $dps.type) "NodePort") (or (lt (int $dps.httpPort) 30000) (gt (int $dps.httpPort) 32767)) -}}
{{- fail (printf "devicePlugin.service.httpPort: %v is not a node port (30000-32767); with devicePlugin.service.type NodePort it is the Service's nodePort, as in HAMi (31992). Choose a port in that range, or type ClusterIP." $dps.httpPort) -}}
{{- end -}}
{{- end -}}

{{/* The init container that installs the CUDA shim and ld.so.preload on the host, for the device
     plugin's and the DRA plugin's DaemonSets: (list $ HOST_VGPU_DIR LIB_PATH). */}}
{{- define "tessera.installVgpuHook" -}}
{{- $ := index . 0 -}}
{{- $hostVgpuDir := index . 1 -}}
{{- $libPath := index . 2 -}}
# Installs the CUDA shim and ld.so.preload on the host before the plugin advertises
# anything. Each file is written beside its target and renamed over it: running
# workloads keep the inode they mapped, and no container ever sees a half-written file.
- name: install-vgpu-hook
  image: {{ include "tessera.tesseraImage" (list $ $.Values.devicePlugin.image "tessera-gpu/tessera-device-plugin") }}
  imagePullPolicy: {{ $.Values.devicePlugin.image.pullPolicy }}
  command:
    - /opt/tessera/bin/busybox
    - sh
    - -ec
    - |
      dir={{ $hostVgpuDir }}
      /opt/tessera/bin/busybox mkdir -p "$dir/containers" "$dir/claims" "$dir/musl"
      /opt/tessera/bin/busybox cp /opt/tessera/lib/libvgpu.so "$dir/.libvgpu.so.new"
      /opt/tessera/bin/busybox mv -f "$dir/.libvgpu.so.new" "$dir/libvgpu.so"
      # The musl build ships only in images built with SHIM_MUSL=1 (docker/README.md).
      if [ -f /opt/tessera/lib/musl/libvgpu.so ]; then
        /opt/tessera/bin/busybox cp /opt/tessera/lib/musl/libvgpu.so "$dir/musl/.libvgpu.so.new"
        /opt/tessera/bin/busybox mv -f "$dir/musl/.libvgpu.so.new" "$dir/musl/libvgpu.so"
        /opt/tessera/bin/busybox chmod 0644 "$dir/musl/libvgpu.so"
      fi
      # The path inside workload containers, where Allocate mounts the shim.
      echo {{ $libPath }}/libvgpu.so > "$dir/.ld.so.preload.new"
      /opt/tessera/bin/busybox mv -f "$dir/.ld.so.preload.new" "$dir/ld.so.preload"
      # Root-owned and not world-writable: only the plugin makes the per-container
      # directories (at Allocate); each container sees just its own.
      /opt/tessera/bin/busybox chown 0:0 "$dir" "$dir/containers"
      /opt/tessera/bin/busybox chmod 0755 "$dir" "$dir/musl" "$dir/containers"
      /opt/tessera/bin/busybox chmod 0644 "$dir/libvgpu.so" "$dir/ld.so.preload"
  securityContext:
    runAsUser: 0
    allowPrivilegeEscalation: false
    readOnlyRootFilesystem: true
    capabilities:
      drop: [ALL]
      add: [CHOWN, DAC_OVERRIDE, FOWNER]
  volumeMounts:
    - name: hook
      mountPath: {{ $hostVgpuDir }}
{{- end -}}

{{- /*
Who may read /metrics (metricsAuthorization): `kubernetes` or `none`, refused otherwise.
*/}}
{{- define "tessera.metricsAuthorization" -}}
{{- $mode := toString (.Values.metricsAuthorization | default "kubernetes") -}}
{{- if not (has $mode (list "kubernetes" "none")) -}}
{{- fail (printf "metricsAuthorization must be `kubernetes` or `none`, not %v" $mode) -}}
{{- end -}}
{{- $mode -}}
{{- end -}}

{{- /*
The daemons' log format (logFormat): `text` or `json`, refused otherwise.
*/}}
{{- define "tessera.logFormat" -}}
{{- $format := toString (.Values.logFormat | default "text") -}}
{{- if not (has $format (list "text" "json")) -}}
{{- fail (printf "logFormat must be `text` or `json`, not %v" $format) -}}
{{- end -}}
{{- $format -}}
{{- end -}}

{{/* Whether the device plugin serves simulated GPUs: simulatedGpus.enabled, or HAMi's
     mockDevicePlugin.enabled (docs/install.md, "Five minutes, no GPU"). */}}
{{- define "tessera.simulatedGpus" -}}
{{- if or (eq (toString .Values.simulatedGpus.enabled) "true") (eq (toString ((.Values.mockDevicePlugin | default dict).enabled)) "true") }}true{{ end -}}
{{- end -}}

{{/* The simulated GPUs' image: simulatedGpus.image, with HAMi's mockDevicePlugin.image.registry
     (a mirror, unless it is Docker Hub, where HAMi's mock image lives) and .pullPolicy when HAMi's
     key turned the mode on. */}}
{{- define "tessera.simulatedGpuImage" -}}
{{- $img := deepCopy .Values.simulatedGpus.image -}}
{{- $mock := .Values.mockDevicePlugin | default dict -}}
{{- if eq (toString $mock.enabled) "true" -}}
{{- $mockImg := $mock.image | default dict -}}
{{- $reg := trimSuffix "/" (toString ($mockImg.registry | default "")) -}}
{{- if and $reg (not (has $reg (list "docker.io" "index.docker.io" "registry-1.docker.io"))) -}}
{{- $_ := set $img "registry" $reg -}}
{{- end -}}
{{- with $mockImg.pullPolicy }}{{ $_ := set $img "pullPolicy" . }}{{ end -}}
{{- end -}}
{{- toJson $img -}}
{{- end -}}
