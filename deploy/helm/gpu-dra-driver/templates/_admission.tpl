{{/* CEL shared by the admission policies (validatingadmissionpolicy*.yaml): one copy of each rule. */}}

{{/* The request comes from a node's kubelet plugin: the chart's plugin service account. */}}
{{- define "gpu-dra-driver.cel.isKubeletPlugin" -}}
request.userInfo.username == 'system:serviceaccount:{{ .Release.Namespace }}:{{ include "gpu-dra-driver.kubeletPluginServiceAccount" . }}'
{{- end }}

{{/* The request comes from the cluster controller: the chart's controller service account. */}}
{{- define "gpu-dra-driver.cel.isController" -}}
request.userInfo.username == 'system:serviceaccount:{{ .Release.Namespace }}:{{ include "gpu-dra-driver.controllerServiceAccount" . }}'
{{- end }}

{{/* The node the plugin runs on, from its pod-bound service-account token (extra
"authentication.kubernetes.io/node-name"); '' when the token names none. */}}
{{- define "gpu-dra-driver.cel.userNodeName" -}}
has(request.userInfo.extra) &&
'authentication.kubernetes.io/node-name' in request.userInfo.extra &&
size(request.userInfo.extra['authentication.kubernetes.io/node-name']) > 0
? request.userInfo.extra['authentication.kubernetes.io/node-name'][0] : ''
{{- end }}

{{/* The validation that the token names a node (without it no node rule can hold). */}}
{{- define "gpu-dra-driver.cel.requireNode" -}}
- expression: variables.userNodeName != ''
  message: >-
    the kubelet plugin's token names no node; it must run in a pod bound to a node, with
    service-account tokens that carry the node name
{{- end }}
