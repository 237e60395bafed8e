{{/* Labels of one part of gpupool; the argument is the part's name (gpupool-driver, gpupool-controller). */}}
{{- define "gpupool.labels" -}}
app.kubernetes.io/name: {{ . }}
app.kubernetes.io/part-of: gpupool
{{- end }}

{{- define "gpupool.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* The kubelet folder that holds the driver's DRA socket and its checkpoint. */}}
{{- define "gpupool.pluginDir" -}}
{{ .Values.kubeletDir }}/plugins/gpupool.dev
{{- end }}
