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

{{- define "tessera.scheduler" -}}{{ include "tessera.fullname" . | trunc 53 | trimSuffix "-" }}-scheduler{{- end -}}
{{- define "tessera.devicePlugin" -}}{{ include "tessera.fullname" . | trunc 49 | trimSuffix "-" }}-device-plugin{{- end -}}
{{- define "tessera.webhook" -}}{{ include "tessera.fullname" . | trunc 55 | trimSuffix "-" }}-webhook{{- end -}}
{{- define "tessera.certgen" -}}{{ include "tessera.fullname" . | trunc 55 | trimSuffix "-" }}-certgen{{- end -}}
{{/* Secret with the webhook/extender serving certificate (keys tls.crt, tls.key, ca.crt after mapping). */}}
{{- define "tessera.servingSecret" -}}{{ include "tessera.scheduler" . }}-tls{{- end -}}
{{/* Secret with kube-scheduler's client certificate for /filter and /bind, and its CA. */}}
{{- define "tessera.clientSecret" -}}{{ include "tessera.scheduler" . }}-extender-client{{- end -}}
{{/* Lease names: kube-scheduler and tessera-scheduler elect separately. */}}
{{- define "tessera.kubeSchedulerLease" -}}{{ include "tessera.fullname" . | trunc 46 | trimSuffix "-" }}-kube-scheduler{{- end -}}
{{- define "tessera.extenderLease" -}}{{ include "tessera.scheduler" . }}-extender{{- end -}}

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

{{/* image ROOT IMAGE: <registry>/<repository>:<tag>. global.imageRegistry replaces every image's
     registry (mirrors); global.imageTag / appVersion apply to an empty tag. */}}
{{- define "tessera.image" -}}
{{- $root := index . 0 -}}
{{- $img := index . 1 -}}
{{- $registry := $root.Values.global.imageRegistry | default $img.registry | default "" | trimSuffix "/" -}}
{{- $tag := $img.tag | default $root.Values.global.imageTag | default $root.Chart.AppVersion -}}
{{- if $registry -}}
{{- printf "%s/%s:%s" $registry $img.repository (toString $tag) -}}
{{- else -}}
{{- printf "%s:%s" $img.repository (toString $tag) -}}
{{- end -}}
{{- end -}}

{{- define "tessera.imagePullSecrets" -}}
{{- with .Values.global.imagePullSecrets }}
imagePullSecrets:
{{- range . }}
{{- if kindIs "string" . }}
  - name: {{ . }}
{{- else }}
  - {{ toYaml . }}
{{- end }}
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
{{- fail "scheduler.enableHTTPS needs a certificate source: set scheduler.certManager.enabled or scheduler.patch.enabled." -}}
{{- end -}}
{{- if lt (int .Values.scheduler.replicas) 1 -}}
{{- fail "scheduler.replicas must be at least 1" -}}
{{- end -}}
{{- if and (gt (int .Values.scheduler.replicas) 1) (not .Values.scheduler.leaderElect) -}}
{{- fail "scheduler.replicas > 1 requires scheduler.leaderElect: several kube-schedulers would bind the same pods." -}}
{{- end -}}
{{- $names := list .Values.resourceName .Values.resourceMem .Values.resourceMemPercentage .Values.resourceCores .Values.resourcePriority -}}
{{- range $names -}}
{{- if not (regexMatch "^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*)/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$" .) -}}
{{- fail (printf "resource name %q is not a valid extended resource name (domain/name)" .) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The service account usernames of the chart's own components (trusted by the webhook). */}}
{{- define "tessera.trustedUsers" -}}
{{- printf "system:serviceaccount:%s:%s,system:serviceaccount:%s:%s" .Release.Namespace (include "tessera.scheduler" .) .Release.Namespace (include "tessera.devicePlugin" .) -}}
{{- end -}}
