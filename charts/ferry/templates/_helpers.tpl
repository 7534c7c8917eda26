{{/* Chart name. */}}
{{- define "ferry.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified app name: the release name, plus the chart name unless the release name already contains it.
Cluster-scoped objects are named from it, so two releases never share a ClusterRole.
*/}}
{{- define "ferry.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Chart name and version, for the helm.sh/chart label. */}}
{{- define "ferry.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Common labels. */}}
{{- define "ferry.labels" -}}
helm.sh/chart: {{ include "ferry.chart" . }}
{{ include "ferry.selectorLabels" . }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: ferry
{{- end }}

{{/* Selector labels (immutable on Deployments/DaemonSets: no version here). */}}
{{- define "ferry.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ferry.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Per-component labels: call with (dict "ctx" $ "component" "operator"). */}}
{{- define "ferry.componentLabels" -}}
{{ include "ferry.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "ferry.componentSelectorLabels" -}}
{{ include "ferry.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* The container images: call with (dict "ctx" $ "repository" ...). */}}
{{- define "ferry.image" -}}
{{- printf "%s:%s" .repository (default .ctx.Chart.AppVersion .ctx.Values.image.tag) }}
{{- end }}

{{- define "ferry.operator.fullname" -}}
{{- printf "%s-operator" (include "ferry.fullname" .) }}
{{- end }}

{{/* The coordination Lease the operator replicas elect their leader on (in the release namespace). */}}
{{- define "ferry.operator.leaseName" -}}
{{- include "ferry.operator.fullname" . }}
{{- end }}

{{- define "ferry.agent.fullname" -}}
{{- printf "%s-agent" (include "ferry.fullname" .) }}
{{- end }}

{{- define "ferry.operator.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create }}
{{- default (include "ferry.operator.fullname" .) .Values.operator.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.operator.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "ferry.agent.serviceAccountName" -}}
{{- if .Values.agent.serviceAccount.create }}
{{- default (include "ferry.agent.fullname" .) .Values.agent.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.agent.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* A tenantNamespaces entry's namespace: the entry itself (string form) or its `name`. */}}
{{- define "ferry.tenant.name" -}}
{{- if kindIs "string" . }}{{ . }}{{ else }}{{ .name }}{{ end }}
{{- end }}

{{/*
The agent's rules in a tenant namespace, given the Secret names it may get (empty: any, by name): those Secrets
(the WeightVersions' credentialsSecret) and its replicas' liveness Leases (the admission policy admits a Lease write
only for the agent's own node).
*/}}
{{- define "ferry.agent.tenantRules" -}}
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
  {{- with . }}
  resourceNames:
    {{- toYaml . | nindent 4 }}
  {{- end }}
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  verbs: [create, get, list, watch, update, patch, delete]
# A trainer pod's publish, only after a SubjectAccessReview said its own ServiceAccount may create it here.
- apiGroups: [ferry.dev]
  resources: [weightversions]
  verbs: [create]
{{- end }}

{{/*
The operator's rules in a tenant namespace, given the Secret names it may get (empty: any, by name): those Secrets
(storage verification), deleting a replica's Lease that names another node than the replica's, so that the
replica's own agent can write its Lease (a squatted name), and listing and watching Pods (a ModelLoad's
spec.podSelector: weights follow the engine pods of its namespace).
*/}}
{{- define "ferry.operator.tenantRules" -}}
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
  {{- with . }}
  resourceNames:
    {{- toYaml . | nindent 4 }}
  {{- end }}
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  verbs: [delete]
- apiGroups: [ferry.dev]
  resources: [weightversions]
  verbs: [delete]
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch]
{{- end }}

{{/*
kube-score checks a workload skips on purpose, as its `kube-score/ignore` annotation; the chart README
("Manifest checks") says why. The argument: the list of check IDs.
*/}}
{{- define "ferry.kubeScoreIgnore" -}}
{{- if . -}}
annotations:
  kube-score/ignore: {{ join "," . | quote }}
{{- end }}
{{- end }}
