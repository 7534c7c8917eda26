{{/*
Ferry attach helpers (docs/consumers.md). In the calling chart's pod template:

  spec:
    volumes:
      {{- include "ferry-consumer.volumes" . | nindent 6 }}
    containers:
      - name: engine
        env:
          {{- include "ferry-consumer.env" . | nindent 10 }}
        volumeMounts:
          {{- include "ferry-consumer.volumeMounts" . | nindent 10 }}

The pod mounts only its own directory of the agent's socket directory (subPathExpr on its UID): the path is
the capability the agent checks.
*/}}

{{- define "ferry-consumer.settings" -}}
{{- $v := .Values.ferry | default dict -}}
hostPath: {{ $v.hostPath | default "/run/ferry" | quote }}
mountPath: {{ $v.mountPath | default "/run/ferry" | quote }}
volumeName: {{ $v.volumeName | default "ferry" | quote }}
hostPathType: {{ $v.hostPathType | default "Directory" | quote }}
modelLoad: {{ $v.modelLoad | default "" | quote }}
{{- end }}

{{- define "ferry-consumer.volumes" -}}
{{- $s := include "ferry-consumer.settings" . | fromYaml -}}
- name: {{ $s.volumeName }}
  hostPath:
    path: {{ $s.hostPath }}
    type: {{ $s.hostPathType }}
{{- end }}

{{- define "ferry-consumer.volumeMounts" -}}
{{- $s := include "ferry-consumer.settings" . | fromYaml -}}
- name: {{ $s.volumeName }}
  mountPath: {{ $s.mountPath }}
  subPathExpr: pods/$(POD_UID)
  readOnly: true
{{- end }}

{{- define "ferry-consumer.env" -}}
{{- $s := include "ferry-consumer.settings" . | fromYaml -}}
- name: POD_UID
  valueFrom:
    fieldRef:
      fieldPath: metadata.uid
- name: FERRY_SOCKET_DIR
  value: {{ $s.mountPath | quote }}
{{- with $s.modelLoad }}
- name: FERRY_MODEL_LOAD
  value: {{ . | quote }}
{{- end }}
{{- end }}
