{{/* ---- names and labels ------------------------------------------------------------- */}}
{{- define "v4serve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "v4serve.fullname" -}}
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

{{- define "v4serve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "v4serve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "v4serve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "v4serve.labels" -}}
helm.sh/chart: {{ include "v4serve.chart" . }}
{{ include "v4serve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* labels of a component: (dict "ctx" $ "component" "router"). Selectors use only the
     v4serve.io/ labels: KubeRay rewrites some app.kubernetes.io/ labels on the pods it makes. */}}
{{- define "v4serve.componentLabels" -}}
{{ include "v4serve.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{ include "v4serve.componentSelector" . }}
{{- end }}

{{- define "v4serve.componentSelector" -}}
v4serve.io/instance: {{ .ctx.Release.Name }}
v4serve.io/component: {{ .component }}
{{- end }}

{{/* pods that are Ray nodes (head, workers, router) may talk to each other on any port */}}
{{- define "v4serve.rayMemberLabel" -}}
v4serve.io/ray-member: "true"
{{- end }}

{{- define "v4serve.rayMemberSelector" -}}
v4serve.io/instance: {{ .Release.Name }}
{{ include "v4serve.rayMemberLabel" . }}
{{- end }}

{{- define "v4serve.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{- define "v4serve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "v4serve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* ---- Ray ---------------------------------------------------------------------------- */}}
{{- define "v4serve.rayCluster" -}}
{{ include "v4serve.fullname" . }}
{{- end }}

{{/* KubeRay names the head Service <cluster>-head-svc */}}
{{- define "v4serve.rayHeadAddress" -}}
{{ include "v4serve.rayCluster" . }}-head-svc.{{ .Release.Namespace }}.svc.cluster.local:6379
{{- end }}

{{- define "v4serve.rayTokenSecret" -}}
{{- .Values.ray.auth.existingSecret | default (printf "%s-ray-token" (include "v4serve.fullname" .)) }}
{{- end }}

{{- define "v4serve.rayAuthEnv" -}}
{{- if .Values.ray.auth.enabled -}}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "v4serve.rayTokenSecret" . }}
      key: token
{{- else -}}
- name: RAY_AUTH_MODE
  value: disabled
{{- end }}
{{- end }}

{{/* one worker group's settings: ray.workers overridden key by key by ray.<role> */}}
{{- define "v4serve.workerValues" -}}
{{- $base := deepCopy .ctx.Values.ray.workers }}
{{- $over := deepCopy (index .ctx.Values.ray .role) }}
{{- toYaml (mustMergeOverwrite $base $over) }}
{{- end }}

{{/* ---- secrets and the registry ------------------------------------------------------- */}}
{{- define "v4serve.apiKeysSecret" -}}
{{- .Values.auth.existingSecret | default (printf "%s-api-keys" (include "v4serve.fullname" .)) }}
{{- end }}

{{/* data keys of the API-key Secret, one key each */}}
{{- define "v4serve.apiKeyNames" -}}
{{- if .Values.auth.existingSecret }}
{{- toYaml .Values.auth.existingSecretKeys }}
{{- else if .Values.auth.apiKeys }}
{{- range $i, $_ := .Values.auth.apiKeys }}
- api-key-{{ $i }}
{{- end }}
{{- else }}
- api-key
{{- end }}
{{- end }}

{{- define "v4serve.redisSecret" -}}
{{- if eq .Values.redis.mode "internal" }}
{{- .Values.redis.internal.existingSecret | default (printf "%s-redis" (include "v4serve.fullname" .)) }}
{{- else }}
{{- .Values.redis.external.existingSecret | default (printf "%s-redis-url" (include "v4serve.fullname" .)) }}
{{- end }}
{{- end }}

{{- define "v4serve.redisService" -}}
{{ include "v4serve.fullname" . }}-redis
{{- end }}

{{/* REDIS_URL for the v4serve processes (pools owner, routers); the workers receive it from the owner */}}
{{- define "v4serve.redisEnv" -}}
{{- if eq .Values.redis.mode "internal" -}}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "v4serve.redisSecret" . }}
      key: redis-password
- name: REDIS_URL
  value: redis://:$(REDIS_PASSWORD)@{{ include "v4serve.redisService" . }}.{{ .Release.Namespace }}.svc.cluster.local:6379/0
{{- else -}}
- name: REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "v4serve.redisSecret" . }}
      key: {{ if .Values.redis.external.existingSecret }}{{ .Values.redis.external.existingSecretKey }}{{ else }}redis-url{{ end }}
{{- end }}
{{- end }}

{{/* a generated secret value kept across upgrades: (dict "ctx" $ "name" secret "key" k "length" n) */}}
{{- define "v4serve.generatedSecretValue" -}}
{{- $existing := lookup "v1" "Secret" .ctx.Release.Namespace .name }}
{{- if and $existing (hasKey ($existing.data | default dict) .key) }}
{{- index $existing.data .key }}
{{- else }}
{{- randAlphaNum (int .length) | b64enc }}
{{- end }}
{{- end }}

{{/* ---- pods --------------------------------------------------------------------------- */}}
{{/* model.source hf: hf://org/name[@revision] → (dict "repo" "org/name" "revision" "rev" or "") */}}
{{- define "v4serve.hfModel" -}}
{{- $ref := trimPrefix "hf://" .Values.model.hf.uri }}
{{- $parts := splitList "@" $ref }}
{{- toYaml (dict "repo" (first $parts) "revision" (ternary (last $parts) "" (eq (len $parts) 2))) }}
{{- end }}

{{/* the claim holding the weights: model.pvc's, or for hf the chart's download volume (or yours) */}}
{{- define "v4serve.modelClaim" -}}
{{- if eq .Values.model.source "hf" }}
{{- .Values.model.hf.pvc.existingClaim | default (printf "%s-models" (include "v4serve.fullname" .)) }}
{{- else }}
{{- .Values.model.pvc.claimName }}
{{- end }}
{{- end }}

{{- define "v4serve.modelVolume" -}}
- name: models
{{- if has .Values.model.source (list "pvc" "hf") }}
  persistentVolumeClaim:
    claimName: {{ include "v4serve.modelClaim" . }}
    readOnly: true
{{- else }}
  hostPath:
    path: {{ .Values.model.hostPath.path }}
    type: {{ .Values.model.hostPath.type }}
{{- end }}
{{- end }}

{{- define "v4serve.modelMount" -}}
- name: models
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}

{{- define "v4serve.modelDir" -}}
{{- if eq .Values.model.source "hf" }}
{{- $hf := include "v4serve.hfModel" . | fromYaml }}
{{- printf "%s/hf/%s/%s" (.Values.model.mountPath | trimSuffix "/") $hf.repo ($hf.revision | default "main") }}
{{- else if .Values.model.path }}
{{- printf "%s/%s" (.Values.model.mountPath | trimSuffix "/") (.Values.model.path | trimPrefix "/") }}
{{- else }}
{{- .Values.model.mountPath }}
{{- end }}
{{- end }}

{{- define "v4serve.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true  # writes go to the /tmp and /dev/shm volumes
capabilities:
  drop: [ALL]
{{- if .rdma }}
  add: [IPC_LOCK]  # pinning RDMA-registered memory
{{- end }}
{{- end }}

{{- define "v4serve.modelDownloadJob" -}}
{{ include "v4serve.fullname" . }}-model-download-{{ .Values.model.hf.uri | sha256sum | trunc 8 }}
{{- end }}

{{/* model.source hf: pods start once the download Job marked the checkpoint complete */}}
{{- define "v4serve.waitForModel" -}}
{{- if eq .Values.model.source "hf" -}}
- name: wait-for-model
  image: {{ include "v4serve.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: ["/bin/sh", "-c"]
  args:
    - >-
      until [ -f "{{ include "v4serve.modelDir" . }}/.v4serve-download-complete" ]; do
      echo "waiting for {{ .Values.model.hf.uri }} to be downloaded (Job {{ include "v4serve.modelDownloadJob" . }})";
      sleep 15; done
  resources:
    requests: {cpu: 10m, memory: 32Mi}
    limits: {memory: 64Mi}
  securityContext:
    {{- include "v4serve.containerSecurityContext" (dict "rdma" false) | nindent 4 }}
  volumeMounts:
    {{- include "v4serve.modelMount" . | nindent 4 }}
{{- end }}
{{- end }}

{{/* the worker pods' engine endpoints: one port per worker of the pod, from engineMetricsPort */}}
{{- define "v4serve.enginePort" -}}
{{ .Values.serving.engineMetricsPort }}
{{- end }}

{{- define "v4serve.httpScheme" -}}
{{ if .Values.tls.enabled }}HTTPS{{ else }}HTTP{{ end }}
{{- end }}

{{/* Ray metrics and the v4serve worker preStop hook are shared by KubeRay groups and the
     KEDA-scaled Deployments: (dict "ctx" $ "role" "prefill" "standalone" bool) */}}
{{- /* The custom resources a pool's worker pod advertises (JSON): its role and
       serving.poolResources[role], which its actors request too (`--prefill/decode-resources`). */}}
{{- define "v4serve.rayResources" -}}
{{- $w := include "v4serve.workerValues" (dict "ctx" .ctx "role" .role) | fromYaml }}
{{- $n := int $w.gpus }}
{{- $extra := index .ctx.Values.serving.poolResources .role | default dict -}}
{{- $out := dict .role $n }}
{{- range $k, $v := $extra }}{{- $_ := set $out $k (mulf $v $n) }}{{- end }}
{{- toJson $out -}}
{{- end }}

{{- define "v4serve.workerPod" -}}
{{- $ := .ctx }}
{{- $w := include "v4serve.workerValues" (dict "ctx" $ "role" .role) | fromYaml }}
{{- $kv := $.Values.kvTransfer -}}
metadata:
  labels:
    {{- with $w.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
    {{- include "v4serve.componentLabels" (dict "ctx" $ "component" .role) | nindent 4 }}
    {{- include "v4serve.rayMemberLabel" $ | nindent 4 }}
  {{- with $w.podAnnotations }}
  annotations:  # e.g. k8s.v1.cni.cncf.io/networks for a Multus / SR-IOV RDMA interface
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  serviceAccountName: {{ include "v4serve.serviceAccountName" $ }}
  automountServiceAccountToken: false
  securityContext:
    {{- toYaml $.Values.podSecurityContext | nindent 4 }}
  {{- range $key := list "runtimeClassName" "priorityClassName" "schedulerName" }}
  {{- with index $w $key }}
  {{ $key }}: {{ . }}
  {{- end }}
  {{- end }}
  {{- with $w.topologySpreadConstraints }}
  topologySpreadConstraints:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if $kv.hostNetwork }}
  hostNetwork: true
  dnsPolicy: ClusterFirstWithHostNet
  {{- end }}
  terminationGracePeriodSeconds: {{ $w.terminationGracePeriodSeconds }}
  {{- with $.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $w.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $w.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $w.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with include "v4serve.waitForModel" $ }}
  initContainers:
    {{- . | nindent 4 }}
  {{- end }}
  containers:
    - name: ray-worker
      image: {{ include "v4serve.image" $ }}
      imagePullPolicy: {{ $.Values.image.pullPolicy }}
      {{- if .standalone }}
      # a Ray worker node joining the RayCluster's head, advertising one `{{ .role }}` slot
      command: ["/usr/bin/tini", "--", "/bin/sh", "-ec"]
      args:
        - >-
          exec ray start --block --address={{ include "v4serve.rayHeadAddress" $ }}
          --resources='{{ include "v4serve.rayResources" (dict "ctx" $ "role" .role) }}' --metrics-export-port=8080 --disable-usage-stats
      {{- end }}
      env:
        {{- include "v4serve.rayAuthEnv" $ | nindent 8 }}
        {{- if $kv.ucxTls }}
        - name: UCX_TLS
          value: {{ $kv.ucxTls | quote }}
        {{- end }}
        {{- if $kv.ucxNetDevices }}
        - name: UCX_NET_DEVICES
          value: {{ $kv.ucxNetDevices | quote }}
        {{- end }}
        {{- with $kv.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
        {{- with $w.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
        - name: TRITON_CACHE_DIR  # the root filesystem is read-only
          value: /tmp/triton
      ports:
        - {name: metrics, containerPort: 8080}
        {{- range $i := until (int $w.gpus) }}
        - {name: engine-{{ $i }}, containerPort: {{ add (int (include "v4serve.enginePort" $)) $i }}}
        {{- end }}
      {{- if $w.livenessProbe.enabled }}
      livenessProbe:  # a wedged step loop: a worker's /health answers 503 (no worker listening yet is fine)
        exec:
          command:
            - /bin/sh
            - -c
            - >-
              for p in {{ range $i := until (int $w.gpus) }}{{ add (int (include "v4serve.enginePort" $)) $i }} {{ end }}; do
              wget -q -T {{ $w.livenessProbe.timeoutSeconds }} -O /dev/null "http://127.0.0.1:$p/health";
              [ $? -eq 8 ] && exit 1; done; exit 0
        periodSeconds: {{ $w.livenessProbe.periodSeconds }}
        timeoutSeconds: {{ mul (int $w.livenessProbe.timeoutSeconds) (add1 (int $w.gpus)) }}
        failureThreshold: {{ $w.livenessProbe.failureThreshold }}
      {{- end }}
      resources:
        requests:
          {{- range $k, $v := $w.resources.requests }}
          {{ $k }}: {{ $v | quote }}
          {{- end }}
          nvidia.com/gpu: {{ $w.gpus | quote }}
          {{- if $kv.rdma.enabled }}
          {{ $kv.rdma.resourceName }}: {{ $kv.rdma.count | quote }}
          {{- end }}
        limits:
          {{- range $k, $v := $w.resources.limits }}
          {{ $k }}: {{ $v | quote }}
          {{- end }}
          nvidia.com/gpu: {{ $w.gpus | quote }}
          {{- if $kv.rdma.enabled }}
          {{ $kv.rdma.resourceName }}: {{ $kv.rdma.count | quote }}
          {{- end }}
      securityContext:
        {{- include "v4serve.containerSecurityContext" (dict "rdma" $kv.rdma.enabled) | nindent 8 }}
      lifecycle:
        preStop:  # finish the work on this pod before it goes (scale-down, eviction, update)
          exec:
            command: [python, -m, cluster.autoscale_actuator, drain-node, --role, {{ .role }}]
      volumeMounts:
        - {name: dshm, mountPath: /dev/shm}
        - {name: tmp, mountPath: /tmp}
        {{- include "v4serve.modelMount" $ | nindent 8 }}
        {{- with $w.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $w.shmSize }}
    - name: tmp
      emptyDir: {}
    {{- include "v4serve.modelVolume" $ | nindent 4 }}
    {{- with $w.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}

{{/* ---- the v4serve processes: pools owner (`v4serve up`) and routers (`v4serve router`) --- */}}
{{/* flags both take, which must agree: the same checkpoint, pools (cluster name), context length */}}
{{- define "v4serve.servingArgs" -}}
{{- $keys := include "v4serve.apiKeyNames" . | fromYamlArray -}}
- --model={{ include "v4serve.modelDir" . }}
- --cluster={{ include "v4serve.fullname" . }}
- --host=0.0.0.0
- --http-port={{ .Values.router.httpPort }}
- --grpc-port={{ .Values.router.grpcPort }}
- --max-model-len={{ .Values.serving.maxModelLen }}
- --remote-prefill-threshold={{ .Values.serving.remotePrefillThreshold }}
{{- if .Values.auth.enabled }}
{{- range $i, $_ := $keys }}
- --api-key=$(V4SERVE_API_KEY_{{ $i }})
{{- end }}
{{- end }}
{{- if .Values.tls.enabled }}
- --tls-cert={{ .Values.tls.mountPath }}/tls.crt
- --tls-key={{ .Values.tls.mountPath }}/tls.key
{{- end }}
{{- end }}

{{/* The pod of a v4serve process: it joins the RayCluster as a node without resources (a Ray
     driver must run on a Ray node; no actor lands there) and then execs `v4serve <args>` against
     it. (dict "ctx" $ "component" "pools"|"router" "pod" <values section> "args" <yaml list>
     "probes" (dict "<probe>" "<path>") "autoscale" bool) */}}
{{- define "v4serve.servingPod" -}}
{{- $ := .ctx }}
{{- $pod := .pod }}
{{- $keys := include "v4serve.apiKeyNames" $ | fromYamlArray -}}
metadata:
  labels:
    {{- include "v4serve.componentLabels" (dict "ctx" $ "component" .component) | nindent 4 }}
    {{- include "v4serve.rayMemberLabel" $ | nindent 4 }}
  {{- if or .autoscale $pod.podAnnotations }}
  annotations:
    {{- if .autoscale }}
    checksum/autoscale: {{ include (print $.Template.BasePath "/configmap.yaml") $ | sha256sum }}
    {{- end }}
    {{- with $pod.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- end }}
spec:
  serviceAccountName: {{ include "v4serve.serviceAccountName" $ }}
  automountServiceAccountToken: false
  securityContext:
    {{- toYaml $.Values.podSecurityContext | nindent 4 }}
  terminationGracePeriodSeconds: {{ $pod.terminationGracePeriodSeconds }}
  {{- with $.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $pod.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $pod.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $pod.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with include "v4serve.waitForModel" $ }}
  initContainers:
    {{- . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ .component }}
      image: {{ include "v4serve.image" $ }}
      imagePullPolicy: {{ $.Values.image.pullPolicy }}
      # join the RayCluster as a node without resources, then run v4serve against it: the args
      # after the script are v4serve's own
      command: ["/usr/bin/tini", "--", "/bin/sh", "-ec"]
      args:
        - >-
          ray start --address="$RAY_HEAD_ADDRESS" --num-cpus=0 --num-gpus=0 --disable-usage-stats;
          exec v4serve "$@"
        - v4serve
        {{- .args | nindent 8 }}
      env:
        - name: RAY_HEAD_ADDRESS
          value: {{ include "v4serve.rayHeadAddress" $ }}
        - name: RAY_ADDRESS
          value: auto  # the node `ray start` just joined
        {{- include "v4serve.rayAuthEnv" $ | nindent 8 }}
        {{- include "v4serve.redisEnv" $ | nindent 8 }}
        {{- if $.Values.auth.enabled }}
        {{- range $i, $k := $keys }}
        - name: V4SERVE_API_KEY_{{ $i }}
          valueFrom:
            secretKeyRef:
              name: {{ include "v4serve.apiKeysSecret" $ }}
              key: {{ $k }}
        {{- end }}
        {{- end }}
        - name: XDG_CACHE_HOME
          value: /tmp/cache
        {{- with $pod.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      ports:
        - {name: http, containerPort: {{ $.Values.router.httpPort }}}
        - {name: grpc, containerPort: {{ $.Values.router.grpcPort }}}
      {{- range $probe, $path := .probes }}
      {{ $probe }}:
        httpGet: {path: {{ $path }}, port: http, scheme: {{ include "v4serve.httpScheme" $ }}}
        periodSeconds: {{ (index $pod $probe).periodSeconds }}
        failureThreshold: {{ (index $pod $probe).failureThreshold }}
      {{- end }}
      resources:
        {{- toYaml $pod.resources | nindent 8 }}
      securityContext:
        {{- include "v4serve.containerSecurityContext" (dict "rdma" false) | nindent 8 }}
      volumeMounts:
        - {name: tmp, mountPath: /tmp}
        {{- include "v4serve.modelMount" $ | nindent 8 }}
        {{- if $.Values.tls.enabled }}
        - {name: tls, mountPath: {{ $.Values.tls.mountPath }}, readOnly: true}
        {{- end }}
        {{- if .autoscale }}
        - {name: autoscale, mountPath: /etc/v4serve/autoscale, readOnly: true}
        {{- end }}
  volumes:
    - name: tmp
      emptyDir: {}
    {{- include "v4serve.modelVolume" $ | nindent 4 }}
    {{- if $.Values.tls.enabled }}
    - name: tls
      secret:
        secretName: {{ $.Values.tls.secretName }}
    {{- end }}
    {{- if .autoscale }}
    - name: autoscale
      configMap:
        name: {{ include "v4serve.fullname" $ }}-autoscale
    {{- end }}
{{- end }}
