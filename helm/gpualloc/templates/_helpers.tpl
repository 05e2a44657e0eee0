{{/*
Names. Every object is "<fullname>-<component>"; fullname is "<release>-gpualloc"
unless the release name already contains the chart name.
*/}}
{{- define "gpualloc.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gpualloc.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "gpualloc.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Per-component names. */}}
{{- define "gpualloc.agent.name" -}}{{ include "gpualloc.fullname" . }}-agent{{- end -}}
{{- define "gpualloc.controller.name" -}}{{ include "gpualloc.fullname" . }}-controller{{- end -}}
{{- define "gpualloc.webhook.name" -}}{{ include "gpualloc.fullname" . }}-webhook{{- end -}}
{{- define "gpualloc.certs.name" -}}{{ include "gpualloc.fullname" . }}-certs{{- end -}}
{{- define "gpualloc.webhook.secretName" -}}{{ include "gpualloc.fullname" . }}-webhook-tls{{- end -}}
{{- define "gpualloc.webhook.configName" -}}{{ include "gpualloc.fullname" . }}{{- end -}}
{{- define "gpualloc.webhook.certName" -}}{{ include "gpualloc.fullname" . }}-webhook-serving{{- end -}}

{{/* Where the agents renew their heartbeat Leases: a namespace of its own, which the agents
may write and the device Leases are not in (gpualloc.api.leases.heartbeat_namespace). */}}
{{- define "gpualloc.heartbeatNamespace" -}}
{{- $name := .Values.agent.heartbeatNamespace | default (printf "%s-heartbeats" .Release.Namespace) -}}
{{- if gt (len $name) 63 -}}
{{- fail (printf "the heartbeat namespace %s is longer than 63 characters: set agent.heartbeatNamespace" $name) -}}
{{- end -}}
{{- if eq $name .Release.Namespace -}}
{{- fail "agent.heartbeatNamespace must not be the release namespace, where the device Leases are" -}}
{{- end -}}
{{- $name -}}
{{- end -}}

{{- define "gpualloc.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Labels on every object. */}}
{{- define "gpualloc.labels" -}}
helm.sh/chart: {{ include "gpualloc.chart" . }}
app.kubernetes.io/name: {{ include "gpualloc.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: gpualloc
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of one component: (dict "root" $ "component" "agent"). */}}
{{- define "gpualloc.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpualloc.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "gpualloc.componentLabels" -}}
{{ include "gpualloc.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Environment every component gets from the downward API. */}}
{{- define "gpualloc.downwardEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
{{- end -}}

{{/* Flags every long-running component takes. */}}
{{- define "gpualloc.commonArgs" -}}
- --log-format={{ .Values.logFormat }}
- --log-level={{ .Values.logLevel }}
{{- end -}}

{{/* Volumes for a read-only root filesystem: a writable /tmp. */}}
{{- define "gpualloc.tmpVolume" -}}
- name: tmp
  emptyDir:
    sizeLimit: 64Mi
{{- end -}}

{{- define "gpualloc.tmpMount" -}}
- name: tmp
  mountPath: /tmp
{{- end -}}

{{/* The issuer of the serving certificate when cert-manager is used. */}}
{{- define "gpualloc.issuerRef" -}}
{{- if .Values.certManager.issuerRef.name -}}
name: {{ .Values.certManager.issuerRef.name }}
kind: {{ default "Issuer" .Values.certManager.issuerRef.kind }}
group: {{ default "cert-manager.io" .Values.certManager.issuerRef.group }}
{{- else -}}
name: {{ include "gpualloc.fullname" . }}-ca
kind: Issuer
group: cert-manager.io
{{- end -}}
{{- end -}}

{{/*
"true" when a MutatingAdmissionPolicy of the given mode is rendered: always, or auto where the
API server serves admissionregistration.k8s.io/v1 MutatingAdmissionPolicy (Kubernetes 1.36+).
Call: include "gpualloc.mutatingPolicyRendered" (dict "root" . "mode" .Values.x.mutatingAdmissionPolicy)
*/}}
{{- define "gpualloc.mutatingPolicyRendered" -}}
{{- $served := .root.Capabilities.APIVersions.Has "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy" -}}
{{- if or (eq .mode "always") (and (eq .mode "auto") $served) }}true{{ end -}}
{{- end -}}

{{/*
"true" when pods without GPUs are steered (packing.steerPodsWithoutClaim): always with true,
never with false, and with auto where the steering MutatingAdmissionPolicy is rendered
(isolation.mutatingAdmissionPolicy): the controller then labels the GPU nodes gpu.scheduling/free-gpus.
*/}}
{{- define "gpualloc.steerPods" -}}
{{- $mode := toString .Values.packing.steerPodsWithoutClaim -}}
{{- $map := include "gpualloc.mutatingPolicyRendered" (dict "root" . "mode" .Values.isolation.mutatingAdmissionPolicy) -}}
{{- if or (eq $mode "true") (and (eq $mode "auto") $map) }}true{{ end -}}
{{- end -}}

{{/*
The spec.strategy a GpuClaim created without one gets (packing.defaultStrategy): the value, or
with auto leastFragmentation where a MutatingAdmissionPolicy is rendered to set it, else binpack
(the claims' own default, which needs no policy).
*/}}
{{- define "gpualloc.defaultStrategy" -}}
{{- $strategy := toString .Values.packing.defaultStrategy -}}
{{- if ne $strategy "auto" -}}
{{ $strategy }}
{{- else if include "gpualloc.mutatingPolicyRendered" (dict "root" . "mode" .Values.isolation.mutatingAdmissionPolicy) -}}
leastFragmentation
{{- else -}}
binpack
{{- end -}}
{{- end -}}

{{/*
"true" when gpualloc is the DRA driver of its own allocations (dra.enabled): always with true,
never with false, and with auto where the API server serves resource.k8s.io/v1 (Kubernetes
1.34+). The controller then writes a ResourceClaim per allocated replica, the webhook puts it
in the claim pods, the agent serves the kubelet's DRA plugin, and the DeviceClass is installed.
*/}}
{{- define "gpualloc.dra" -}}
{{- $mode := toString .Values.dra.enabled -}}
{{- $served := .Capabilities.APIVersions.Has "resource.k8s.io/v1" -}}
{{- if or (eq $mode "true") (and (eq $mode "auto") $served) }}true{{ end -}}
{{- end -}}
