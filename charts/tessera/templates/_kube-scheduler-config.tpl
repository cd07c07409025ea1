{{/*
The KubeSchedulerConfiguration of the kube-scheduler sidecar: HAMi's (contract §4.5) with
Tessera's extender. kube-scheduler reaches the extender over the pod's loopback interface, so
`insecure: true` only skips checking the server name 127.0.0.1 (which no certificate names);
nothing outside the pod can sit in between. The extender authenticates kube-scheduler by its
client certificate (mutual TLS).
*/}}
{{- define "tessera.kubeSchedulerConfig" -}}
apiVersion: {{ .Values.scheduler.kubeScheduler.configApiVersion }}
kind: KubeSchedulerConfiguration
leaderElection:
  leaderElect: {{ .Values.scheduler.leaderElect }}
  resourceLock: leases
  resourceName: {{ include "tessera.kubeSchedulerLease" . }}
  resourceNamespace: {{ include "tessera.namespace" . }}
profiles:
  - schedulerName: {{ .Values.schedulerName }}
extenders:
{{- if .Values.scheduler.enableHTTPS }}
  - urlPrefix: "https://127.0.0.1:{{ .Values.scheduler.httpsPort }}"
    enableHTTPS: true
    tlsConfig:
      insecure: true
      {{- if .Values.scheduler.extenderClientAuth }}
      certFile: /extender-client/tls.crt
      keyFile: /extender-client/tls.key
      {{- end }}
{{- else }}
  - urlPrefix: "http://127.0.0.1:{{ .Values.scheduler.httpsPort }}"
    enableHTTPS: false
{{- end }}
    filterVerb: filter
    bindVerb: bind
    {{- if .Values.scheduler.preemption.enabled }}
    preemptVerb: preempt
    {{- end }}
    nodeCacheCapable: true
    weight: 1
    httpTimeout: {{ .Values.scheduler.extenderHTTPTimeout }}
    managedResources:
      - name: {{ .Values.resourceName }}
        ignoredByScheduler: {{ not (and .Values.scheduler.preemption.enabled .Values.scheduler.preemption.countSlots) }}
      - name: {{ .Values.resourceMem }}
        ignoredByScheduler: true
      - name: {{ .Values.resourceCores }}
        ignoredByScheduler: true
      - name: {{ .Values.resourceMemPercentage }}
        ignoredByScheduler: true
      - name: {{ .Values.resourcePriority }}
        ignoredByScheduler: true
{{- end -}}
