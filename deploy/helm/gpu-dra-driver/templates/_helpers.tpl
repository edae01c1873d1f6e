{{/* Names and labels shared by all templates. */}}

{{- define "gpu-dra-driver.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "gpu-dra-driver.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "gpu-dra-driver.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "gpu-dra-driver.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* The DRA driver name: fixed to NVIDIA's in compatibility mode. */}}
{{- define "gpu-dra-driver.driverName" -}}
{{- if .Values.compatNvidia }}gpu.nvidia.com{{ else }}{{ required "driverName is required" .Values.driverName }}{{ end }}
{{- end }}

{{- define "gpu-dra-driver.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "gpu-dra-driver.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: gpu-dra-driver
{{- end }}

{{- define "gpu-dra-driver.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpu-dra-driver.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- /* The chart's own image (no image.tag) is pinned by the digest a release records in Chart.yaml: an annotation,
not a value, since `helm upgrade --reuse-values` keeps the old chart's values and so would keep its digest. A tag of
your own is taken as it is; image.digest pins any image. */}}
{{- define "gpu-dra-driver.image" -}}
{{- $digest := .Values.image.digest -}}
{{- if and (not $digest) (not .Values.image.tag) -}}
{{- $digest = index (.Chart.Annotations | default dict) "gpu.dra-driver.io/image-digest" | default "" -}}
{{- end -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}{{ with $digest }}@{{ . }}{{ end }}
{{- end }}

{{- define "gpu-dra-driver.kubeletPluginServiceAccount" -}}
{{ include "gpu-dra-driver.fullname" . }}-kubelet-plugin
{{- end }}

{{- define "gpu-dra-driver.controllerServiceAccount" -}}
{{ include "gpu-dra-driver.fullname" . }}-controller
{{- end }}

{{/* The names of the DeviceClasses the controller keeps, as a JSON list: those of the chart's class files
(generated from api/deviceclasses.py, as the controller's own list is), with this release's driver name. Its RBAC
names them, and its admission policy holds its class writes to them. */}}
{{- define "gpu-dra-driver.deviceClassNames" -}}
{{- $classFile := ternary "files/deviceclasses-nvidia-compat.yaml" "files/deviceclasses.yaml" (.Values.compatNvidia | default false) }}
{{- $classes := .Files.Get $classFile | replace "driver-name.placeholder.invalid" (include "gpu-dra-driver.driverName" .) }}
{{- $classNames := list }}
{{- range $doc := splitList "\n---" $classes }}
{{- $obj := fromYaml $doc }}
{{- if and $obj $obj.metadata }}
{{- $classNames = append $classNames $obj.metadata.name }}
{{- end }}
{{- end }}
{{- $classNames | toJson }}
{{- end }}

{{/* envFrom of the processes that talk to the API server: the explicit endpoint, when k8sServiceHost is set. */}}
{{- define "gpu-dra-driver.kubernetesApiEnvFrom" -}}
{{- if .Values.k8sServiceHost }}
# KUBERNETES_SERVICE_HOST/PORT from the chart override those the kubelet derives from the kubernetes Service.
envFrom:
- configMapRef:
    name: {{ include "gpu-dra-driver.fullname" . }}-kubernetes-api
{{- end }}
{{- end }}
