{{/*
Pod template shared by the Deployment and the DaemonSet.
*/}}
{{- define "ddtree.podTemplate" -}}
{{- if and .Values.mps.enabled (not .Values.hostIPC) }}
{{- fail "mps.enabled needs hostIPC: true (MPS clients share the node's IPC namespace with the daemon)" }}
{{- end }}
metadata:
  labels:
    {{- include "ddtree.labels" . | nindent 4 }}
    {{- with .Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with .Values.podAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  serviceAccountName: {{ include "ddtree.serviceAccountName" . }}
  automountServiceAccountToken: {{ .Values.serviceAccount.automountToken }}
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if .Values.hostIPC }}
  hostIPC: true
  {{- end }}
  {{- if .Values.hostPID }}
  hostPID: true
  {{- end }}
  {{- with .Values.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with .Values.runtimeClassName }}
  runtimeClassName: {{ . }}
  {{- end }}
  terminationGracePeriodSeconds: {{ .Values.terminationGracePeriodSeconds }}
  securityContext:
    {{- toYaml .Values.podSecurityContext | nindent 4 }}
  {{- if and .Values.unixSocket.enabled .Values.unixSocket.prepareHostPath }}
  initContainers:
    - name: socket-dir
      image: {{ include "ddtree.image" . }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      # The hostPath directory is created by the kubelet as root; hand it to the pod's user and
      # group so that the non-root server can create its socket there.
      command:
        - python3
        - -c
        - "import os, sys; p = sys.argv[1]; os.chown(p, int(sys.argv[2]), int(sys.argv[3])); os.chmod(p, 0o770)"
        - {{ .Values.unixSocket.mountPath | quote }}
        - {{ .Values.podSecurityContext.runAsUser | default 10001 | quote }}
        - {{ .Values.podSecurityContext.runAsGroup | default 10001 | quote }}
      securityContext:
        runAsNonRoot: false
        runAsUser: 0
        allowPrivilegeEscalation: false
        readOnlyRootFilesystem: true
        capabilities:
          drop:
            - ALL
          add:
            - CHOWN
            - FOWNER
      volumeMounts:
        - name: socket
          mountPath: {{ .Values.unixSocket.mountPath }}
  {{- end }}
  containers:
    - name: ddtree
      image: {{ include "ddtree.image" . }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      args:
        - serve
      env:
        - name: DDTREE_LISTEN
          value: {{ include "ddtree.listen" . | quote }}
        {{- if .Values.metrics.enabled }}
        - name: DDTREE_METRICS_PORT
          value: {{ .Values.ports.metrics | quote }}
        - name: DDTREE_METRICS_HOST
          value: {{ .Values.server.listenHost | quote }}
        {{- end }}
        - name: DDTREE_DEVICE
          value: {{ .Values.server.device | quote }}
        - name: DDTREE_BACKEND
          value: {{ .Values.server.backend | quote }}
        - name: DDTREE_LOG_LEVEL
          value: {{ .Values.server.logLevel | quote }}
        - name: DDTREE_GRPC_IO
          value: {{ .Values.server.grpcIo | quote }}
        - name: DDTREE_MAX_CONCURRENT_CALLS
          value: {{ .Values.server.maxConcurrentCalls | quote }}
        - name: DDTREE_MAX_MESSAGE_BYTES
          value: {{ .Values.server.maxMessageBytes | int64 | quote }}
        - name: DDTREE_REQUEST_DEADLINE_CAP_S
          value: {{ .Values.server.requestDeadlineCapSeconds | quote }}
        - name: DDTREE_GRACE_S
          value: {{ .Values.server.graceSeconds | quote }}
        - name: DDTREE_DISABLE_JIT
          value: {{ ternary "1" "0" .Values.server.disableJit | quote }}
        - name: DDTREE_CACHE_DIR
          value: {{ .Values.kernelCache.mountPath | quote }}
        - name: DDTREE_MAX_REGISTERED_REGIONS
          value: {{ .Values.limits.maxRegisteredRegions | int64 | quote }}
        - name: DDTREE_MAX_REGISTERED_BYTES
          value: {{ .Values.limits.maxRegisteredBytes | int64 | quote }}
        - name: DDTREE_MEMORY_IDLE_TIMEOUT_S
          value: {{ .Values.limits.memoryIdleTimeoutSeconds | quote }}
        - name: DDTREE_MAX_CHANNELS
          value: {{ .Values.limits.maxChannels | int64 | quote }}
        - name: DDTREE_BIND_REGIONS_TO_CLIENT
          value: {{ ternary "1" "0" .Values.limits.bindRegionsToClient | quote }}
        - name: DDTREE_MAX_CONCURRENT_CALLS_PER_CLIENT
          value: {{ .Values.limits.maxConcurrentCallsPerClient | int64 | quote }}
        - name: DDTREE_MAX_REGIONS_PER_CLIENT
          value: {{ .Values.limits.maxRegionsPerClient | int64 | quote }}
        - name: DDTREE_MAX_REGISTERED_BYTES_PER_CLIENT
          value: {{ .Values.limits.maxRegisteredBytesPerClient | int64 | quote }}
        - name: DDTREE_KEEPALIVE_TIME_S
          value: {{ .Values.keepalive.timeSeconds | quote }}
        - name: DDTREE_KEEPALIVE_TIMEOUT_S
          value: {{ .Values.keepalive.timeoutSeconds | quote }}
        - name: DDTREE_KEEPALIVE_PERMIT_WITHOUT_CALLS
          value: {{ ternary "1" "0" .Values.keepalive.permitWithoutCalls | quote }}
        - name: DDTREE_KEEPALIVE_MIN_PING_INTERVAL_S
          value: {{ .Values.keepalive.minPingIntervalSeconds | quote }}
        - name: DDTREE_KEEPALIVE_MAX_PING_STRIKES
          value: {{ .Values.keepalive.maxPingStrikes | int64 | quote }}
        - name: DDTREE_MAX_CONNECTION_IDLE_S
          value: {{ .Values.keepalive.maxConnectionIdleSeconds | quote }}
        - name: DDTREE_MAX_CONNECTION_AGE_S
          value: {{ .Values.keepalive.maxConnectionAgeSeconds | quote }}
        - name: DDTREE_MAX_CONNECTION_AGE_GRACE_S
          value: {{ .Values.keepalive.maxConnectionAgeGraceSeconds | quote }}
        {{- if .Values.unixSocket.enabled }}
        - name: DDTREE_UNIX_SOCKET_MODE
          value: {{ .Values.unixSocket.mode | quote }}
        {{- end }}
        {{- if .Values.mps.enabled }}
        - name: CUDA_MPS_PIPE_DIRECTORY
          value: {{ .Values.mps.mountPath | quote }}
        {{- end }}
        {{- with .Values.gpu.visibleDevices }}
        - name: NVIDIA_VISIBLE_DEVICES
          value: {{ . | quote }}
        {{- end }}
        {{- with .Values.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      ports:
        - name: grpc
          containerPort: {{ .Values.ports.grpc }}
          protocol: TCP
        {{- if .Values.metrics.enabled }}
        - name: metrics
          containerPort: {{ .Values.ports.metrics }}
          protocol: TCP
        {{- end }}
      # Native gRPC probes (grpc.health.v1) take a port number, not a name. The server reports
      # NOT_SERVING until its kernels are warm, so the startup probe bounds warm-up.
      startupProbe:
        grpc:
          port: {{ .Values.ports.grpc }}
        periodSeconds: {{ .Values.probes.startup.periodSeconds }}
        failureThreshold: {{ .Values.probes.startup.failureThreshold }}
        timeoutSeconds: {{ .Values.probes.startup.timeoutSeconds }}
      livenessProbe:
        grpc:
          port: {{ .Values.ports.grpc }}
        periodSeconds: {{ .Values.probes.liveness.periodSeconds }}
        failureThreshold: {{ .Values.probes.liveness.failureThreshold }}
        timeoutSeconds: {{ .Values.probes.liveness.timeoutSeconds }}
      readinessProbe:
        grpc:
          port: {{ .Values.ports.grpc }}
        periodSeconds: {{ .Values.probes.readiness.periodSeconds }}
        failureThreshold: {{ .Values.probes.readiness.failureThreshold }}
        timeoutSeconds: {{ .Values.probes.readiness.timeoutSeconds }}
      securityContext:
        {{- toYaml .Values.securityContext | nindent 8 }}
      resources:
        {{- $resources := deepCopy (.Values.resources | default dict) }}
        {{- if gt (int .Values.gpu.count) 0 }}
        {{- $gpu := dict .Values.gpu.resourceName (int .Values.gpu.count) }}
        {{- $_ := set $resources "limits" (merge (get $resources "limits" | default dict) $gpu) }}
        {{- $_ := set $resources "requests" (merge (get $resources "requests" | default dict) $gpu) }}
        {{- end }}
        {{- toYaml $resources | nindent 8 }}
      volumeMounts:
        - name: kernel-cache
          mountPath: {{ .Values.kernelCache.mountPath }}
        - name: tmp
          mountPath: /tmp
        {{- if .Values.unixSocket.enabled }}
        - name: socket
          mountPath: {{ .Values.unixSocket.mountPath }}
        {{- end }}
        {{- if .Values.mps.enabled }}
        - name: mps-pipe
          mountPath: {{ .Values.mps.mountPath }}
        {{- end }}
        {{- with .Values.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    - name: kernel-cache
      {{- if .Values.kernelCache.volume }}
      {{- toYaml .Values.kernelCache.volume | nindent 6 }}
      {{- else }}
      emptyDir:
        sizeLimit: {{ .Values.kernelCache.sizeLimit }}
      {{- end }}
    - name: tmp
      emptyDir:
        sizeLimit: 256Mi
    {{- if .Values.unixSocket.enabled }}
    - name: socket
      hostPath:
        path: {{ .Values.unixSocket.hostPath }}
        type: DirectoryOrCreate
    {{- end }}
    {{- if .Values.mps.enabled }}
    - name: mps-pipe
      hostPath:
        # Made by the node's MPS control daemon: a pod scheduled before it waits, not a new
        # directory no daemon listens on.
        path: {{ .Values.mps.pipeDirectory }}
        type: Directory
    {{- end }}
    {{- with .Values.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with .Values.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
