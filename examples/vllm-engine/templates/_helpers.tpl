{{/* The pods' labels: what the Deployment and the ModelLoad's podSelector select. */}}
{{- define "vllm-engine.selectorLabels" -}}
app.kubernetes.io/name: vllm-engine
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
The node label the operator sets where a replica of the ModelLoad serves (status.warmNodeLabel): as
ferry.api.models.warm_node_label computes it, `warm.ferry.dev/<ns>_<name>` cut to 52 characters (trailing `-._`
dropped) and `-` + the first 10 hex digits of sha256("<ns>/<name>").
*/}}
{{- define "vllm-engine.warmNodeLabel" -}}
{{- $ns := .Release.Namespace -}}
{{- $name := required "ferry.modelLoad is required" .Values.ferry.modelLoad -}}
{{- $readable := regexReplaceAll "[-._]+$" (printf "%s_%s" $ns $name | trunc 52) "" -}}
{{- printf "warm.ferry.dev/%s-%s" $readable (sha256sum (printf "%s/%s" $ns $name) | trunc 10) -}}
{{- end }}
