{{/*
Chart name, truncated to the 63 characters Kubernetes allows in a label value.
*/}}
{{- define "ddtree.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified app name: the release name, plus the chart name unless the release already
contains it.
*/}}
{{- define "ddtree.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Chart name and version, for the helm.sh/chart label.
*/}}
{{- define "ddtree.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Selector labels: only name and instance, so they never change across upgrades.
*/}}
{{- define "ddtree.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ddtree.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Common labels.
*/}}
{{- define "ddtree.labels" -}}
{{ include "ddtree.selectorLabels" . }}
app.kubernetes.io/version: {{ include "ddtree.imageTag" . | quote }}
app.kubernetes.io/component: tree-speculation
app.kubernetes.io/part-of: ddtree
helm.sh/chart: {{ include "ddtree.chart" . }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
Name of the service account the pods run as.
*/}}
{{- define "ddtree.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "ddtree.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
Image tag: image.tag, else the chart's appVersion (never "latest").
*/}}
{{- define "ddtree.imageTag" -}}
{{- default .Chart.AppVersion .Values.image.tag }}
{{- end }}

{{/*
Image reference: repository:tag, or repository@digest when a digest is pinned.
*/}}
{{- define "ddtree.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (include "ddtree.imageTag" .) }}
{{- end }}
{{- end }}

{{/*
Listen addresses for DDTREE_LISTEN: TCP on every interface, plus the Unix socket when enabled.
*/}}
{{- define "ddtree.listen" -}}
{{- $addresses := list (printf "%s:%d" .Values.server.listenHost (int .Values.ports.grpc)) }}
{{- if .Values.unixSocket.enabled }}
{{- $addresses = append $addresses (printf "unix:%s/%s" .Values.unixSocket.mountPath .Values.unixSocket.fileName) }}
{{- end }}
{{- join "," $addresses }}
{{- end }}
