{{/*
CEL pieces shared by the isolation policies (isolation-policies.yaml). Each renders
one CEL expression, on one line, to be put into a YAML block scalar.
*/}}

{{/* Namespaces the isolation policies leave alone: the release namespace and the admin's list. */}}
{{- define "gpualloc.isolation.exemptNamespaces" -}}
{{- concat (list .Release.Namespace) .Values.isolation.exemptNamespaces | uniq | toJson -}}
{{- end -}}

{{/* Namespaces the webhook is never called for (the MutatingWebhookConfiguration's list). */}}
{{- define "gpualloc.isolation.webhookExcluded" -}}
{{- concat (list "kube-system" .Release.Namespace) .Values.webhook.excludeNamespaces | uniq | toJson -}}
{{- end -}}

{{/*
Whether the pod is a claim pod: one the webhook is called for and writes the devices
into. With the webhook disabled, or in a namespace it is not called for, the annotation
means nothing, and such a pod is treated like any other pod.
*/}}
{{- define "gpualloc.isolation.claimPod" -}}
{{- if .Values.webhook.enabled -}}
has(object.metadata.annotations) && 'gpu.scheduling/claim' in object.metadata.annotations && !(request.namespace in {{ include "gpualloc.isolation.webhookExcluded" . }})
{{- else -}}
false
{{- end -}}
{{- end -}}

{{/*
Whether the pod gets its GPUs another way: a container or init container requests a
device-plugin resource (isolation.exemptResources; "prefix*" matches by prefix) in a
quantity above zero, or the pod has DRA resource claims (isolation.exemptResourceClaims).
*/}}
{{- define "gpualloc.isolation.pluginPod" -}}
{{- $exact := list -}}
{{- $prefixes := list -}}
{{- range .Values.isolation.exemptResources -}}
{{- if hasSuffix "*" . -}}
{{- $prefixes = append $prefixes (trimSuffix "*" .) -}}
{{- else -}}
{{- $exact = append $exact . -}}
{{- end -}}
{{- end -}}
{{- $requests := printf "[c.?resources.?limits.orValue({}), c.?resources.?requests.orValue({})].exists(m, m.exists(k, (k in %s || %s.exists(p, k.startsWith(p))) && quantity(string(m[k])).isGreaterThan(quantity('0'))))" (toJson $exact) (toJson $prefixes) -}}
object.spec.containers.exists(c, {{ $requests }}) || object.spec.?initContainers.orValue([]).exists(c, {{ $requests }})
{{- if .Values.isolation.exemptResourceClaims }} || size(object.spec.?resourceClaims.orValue([])) > 0{{ end }}
{{- end -}}

{{/*
JSON Patch operations that make NVIDIA_VISIBLE_DEVICES=void the definition of the variable
in each container of a list, for (dict "path" "/spec/containers" "list" "<CEL list>"
"when" "<CEL condition on c>"): an entry of that name (value or valueFrom) is replaced in
place, every one of them if there are several; a container without one gets it appended,
or an env list holding it. A container that has only void entries gets no operation.
*/}}
{{- define "gpualloc.isolation.voidOps" -}}
{{- $void := "{'name': 'NVIDIA_VISIBLE_DEVICES', 'value': 'void'}" -}}
{{ .list }}.transformList(i, c, {{ .when }},
!has(c.env) ? [JSONPatch{op: 'add', path: '{{ .path }}/' + string(i) + '/env', value: [{{ $void }}]}] :
c.env.exists(e, e.name == 'NVIDIA_VISIBLE_DEVICES') ?
c.env.transformList(j, e, e.name == 'NVIDIA_VISIBLE_DEVICES' && (has(e.valueFrom) || e.?value.orValue('') != 'void'),
JSONPatch{op: 'replace', path: '{{ .path }}/' + string(i) + '/env/' + string(j), value: {{ $void }}}) :
[JSONPatch{op: 'add', path: '{{ .path }}/' + string(i) + '/env/-', value: {{ $void }}}]
).flatten()
{{- end -}}

{{/* "container: NAME=value" or "container: NAME from valueFrom", for messages; c and e bound. */}}
{{- define "gpualloc.isolation.describeEntry" -}}
c.name + ': ' + e.name + (has(e.valueFrom) ? ' from valueFrom' : '="' + e.?value.orValue('') + '"')
{{- end -}}

{{/*
What the isolation policies look at: pods being created, and pods/ephemeralcontainers
updates (what `kubectl debug` sends), outside the exempt namespaces (given as a JSON list).
*/}}
{{- define "gpualloc.isolation.matchConstraints" -}}
matchConstraints:
  resourceRules:
    - apiGroups: [""]
      apiVersions: [v1]
      operations: [CREATE]
      resources: [pods]
    - apiGroups: [""]
      apiVersions: [v1]
      operations: [UPDATE]
      resources: [pods/ephemeralcontainers]
  namespaceSelector:
    matchExpressions:
      - key: kubernetes.io/metadata.name
        operator: NotIn
        values: {{ . }}
{{- end -}}
