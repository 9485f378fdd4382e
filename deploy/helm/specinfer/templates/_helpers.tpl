{{/* Names. */}}
{{- define "specinfer.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's base name; truncated so "<fullname>-verifier-lws-<i>-<j>" pod names and
"<fullname>-speculator" Service names stay valid DNS labels. */}}
{{- define "specinfer.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "specinfer.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels: call with (dict "root" $ "component" "router"). */}}
{{- define "specinfer.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specinfer.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "specinfer.labels" -}}
helm.sh/chart: {{ include "specinfer.chart" .root }}
{{ include "specinfer.selectorLabels" . }}
app.kubernetes.io/part-of: specinfer
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- end }}

{{/* Labels shared by every object of the release (no component). */}}
{{- define "specinfer.releaseLabels" -}}
helm.sh/chart: {{ include "specinfer.chart" . }}
app.kubernetes.io/name: {{ include "specinfer.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: specinfer
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The image for a device: (dict "root" $ "device" "cuda"). */}}
{{- define "specinfer.image" -}}
{{- $img := .root.Values.image }}
{{- $tag := default .root.Chart.AppVersion $img.tag }}
{{- if eq .device "cuda" }}
{{- if $img.cudaDigest }}{{ printf "%s@%s" $img.repository $img.cudaDigest }}
{{- else }}{{ printf "%s:%s%s" $img.repository $tag $img.cudaSuffix }}{{ end }}
{{- else }}
{{- if $img.digest }}{{ printf "%s@%s" $img.repository $img.digest }}
{{- else }}{{ printf "%s:%s" $img.repository $tag }}{{ end }}
{{- end }}
{{- end }}

{{/* The --llm value. */}}
{{- define "specinfer.llm" -}}
{{- $m := .Values.model }}
{{- if eq $m.source "builtin" }}
{{- $m.ref }}
{{- else if $m.path }}
{{- printf "%s/%s" (trimSuffix "/" $m.mountPath) (trimPrefix "/" $m.path) }}
{{- else }}
{{- $m.mountPath }}
{{- end }}
{{- end }}

{{- define "specinfer.apiKeySecret" -}}
{{- if .Values.auth.existingSecret }}{{ .Values.auth.existingSecret }}
{{- else }}{{ include "specinfer.fullname" . }}-api-keys{{ end }}
{{- end }}

{{- define "specinfer.authEnabled" -}}
{{- if or .Values.auth.existingSecret .Values.auth.apiKeys }}true{{ end }}
{{- end }}

{{/* TLS flags every service takes. */}}
{{- define "specinfer.tlsArgs" -}}
{{- if .Values.tls.enabled }}
- --tls-cert={{ .Values.tls.mountPath }}/tls.crt
- --tls-key={{ .Values.tls.mountPath }}/tls.key
{{- if .Values.tls.mutual }}
- --tls-ca={{ .Values.tls.mountPath }}/ca.crt
{{- end }}
{{- end }}
{{- end }}

{{/* Environment every pod gets. */}}
{{- define "specinfer.commonEnv" -}}
- name: HOME
  value: /tmp
- name: SPECINFER_CACHE
  value: /var/cache/specinfer
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
{{- if .Values.tracing.otlpEndpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ .Values.tracing.otlpEndpoint | quote }}
{{- if .Values.tracing.protocol }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ .Values.tracing.protocol | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* Volumes every pod gets: /tmp, the cache, the model, TLS. */}}
{{- define "specinfer.commonVolumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: 1Gi
- name: cache
{{- if .Values.cache.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.cache.existingClaim }}
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.cache.sizeLimit }}
{{- end }}
{{- if eq .Values.model.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required with model.source: pvc" .Values.model.pvc.claimName }}
    readOnly: true
{{- else if eq .Values.model.source "image" }}
- name: model
  image:
    reference: {{ required "model.image.reference is required with model.source: image" .Values.model.image.reference }}
    pullPolicy: {{ .Values.model.image.pullPolicy }}
{{- end }}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ required "tls.secretName is required with tls.enabled" .Values.tls.secretName }}
    defaultMode: 0440
{{- end }}
{{- end }}

{{- define "specinfer.commonMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /var/cache/specinfer
{{- if ne .Values.model.source "builtin" }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- if and (eq .Values.model.source "pvc") .Values.model.pvc.subPath }}
  subPath: {{ .Values.model.pvc.subPath }}
{{- end }}
{{- end }}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: {{ .Values.tls.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{/* Probes: (dict "root" $ "probes" .Values.x.probes "port" N "tlsProbe" bool).
Startup and readiness ask the gRPC health service (native grpc probes; with TLS, which the
kubelet's grpc probe cannot speak, an exec probe runs the same check over TLS). Liveness is
a TCP connect to the gRPC port: it cannot fail because the model is busy. */}}
{{- define "specinfer.healthCheck" -}}
{{- if .root.Values.tls.enabled }}
exec:
  command:
    - python3
    - -c
    - |
      import sys, grpc
      from grpc_health.v1 import health_pb2, health_pb2_grpc
      d = "{{ .root.Values.tls.mountPath }}/"
      r = lambda n: open(d + n, "rb").read()
      creds = grpc.ssl_channel_credentials(r("ca.crt"), r("tls.key"), r("tls.crt"))
      ch = grpc.secure_channel("127.0.0.1:{{ .port }}", creds, options=[("grpc.ssl_target_name_override", "{{ .root.Values.tls.serverName }}")])
      s = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=4).status
      sys.exit(0 if s == health_pb2.HealthCheckResponse.SERVING else 1)
{{- else }}
grpc:
  port: {{ .port }}
{{- end }}
{{- end }}

{{- define "specinfer.probes" -}}
startupProbe:
  {{- include "specinfer.healthCheck" . | nindent 2 }}
  periodSeconds: {{ .probes.startup.periodSeconds }}
  failureThreshold: {{ .probes.startup.failureThreshold }}
  timeoutSeconds: {{ .probes.startup.timeoutSeconds }}
readinessProbe:
  {{- include "specinfer.healthCheck" . | nindent 2 }}
  periodSeconds: {{ .probes.readiness.periodSeconds }}
  failureThreshold: {{ .probes.readiness.failureThreshold }}
  timeoutSeconds: {{ .probes.readiness.timeoutSeconds }}
livenessProbe:
  tcpSocket:
    port: {{ .port }}
  periodSeconds: {{ .probes.liveness.periodSeconds }}
  failureThreshold: {{ .probes.liveness.failureThreshold }}
  timeoutSeconds: {{ .probes.liveness.timeoutSeconds }}
{{- end }}

{{/* Pod-level settings shared by every pod: (dict "root" $ "c" .Values.x "device" d). */}}
{{- define "specinfer.podSpecCommon" -}}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .root.Values.podSecurityContext | nindent 2 }}
{{- if and (eq .device "cuda") .c.runtimeClassName }}
runtimeClassName: {{ .c.runtimeClassName }}
{{- end }}
{{- with .c.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .c.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .c.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Pod annotations: (dict "root" $ "c" .Values.x). */}}
{{- define "specinfer.podAnnotations" -}}
{{- $a := merge (dict) (.c.podAnnotations | default dict) (.root.Values.podAnnotations | default dict) }}
{{- with $a }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Container resources, with nvidia.com/gpu limits = gpus when > 0:
(dict "resources" .Values.x.resources "gpus" N). */}}
{{- define "specinfer.resources" -}}
{{- $r := deepCopy .resources }}
{{- if gt (int .gpus) 0 }}
{{- $limits := $r.limits | default dict }}
{{- $_ := set $limits "nvidia.com/gpu" (int .gpus) }}
{{- $_ := set $r "limits" $limits }}
{{- end }}
{{- toYaml $r }}
{{- end }}

{{/* The KEDA Prometheus query. */}}
{{- define "specinfer.kedaQuery" -}}
{{- if .Values.autoscaling.prometheus.query }}
{{- tpl .Values.autoscaling.prometheus.query . }}
{{- else }}
{{- printf "sum(specinfer:num_requests_waiting{namespace=\"%s\"})" .Release.Namespace }}
{{- end }}
{{- end }}
