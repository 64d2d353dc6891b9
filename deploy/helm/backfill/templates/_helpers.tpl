{{/* Names */}}
{{- define "backfill.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "backfill.fullname" -}}
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

{{- define "backfill.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels: the common ones, then those of one component (api, worker, scheduler, migrations). */}}
{{- define "backfill.selectorLabels" -}}
app.kubernetes.io/name: {{ include "backfill.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "backfill.labels" -}}
helm.sh/chart: {{ include "backfill.chart" . }}
{{ include "backfill.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: backfill
{{- end }}

{{/* Call with (dict "ctx" $ "component" "api") */}}
{{- define "backfill.componentSelectorLabels" -}}
{{ include "backfill.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "backfill.componentLabels" -}}
{{ include "backfill.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "backfill.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag | toString) }}
{{- end }}

{{- define "backfill.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "backfill.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "backfill.secretName" -}}
{{- default (include "backfill.fullname" .) .Values.secrets.existingSecret }}
{{- end }}

{{- define "backfill.configName" -}}
{{- printf "%s-config" (include "backfill.fullname" .) }}
{{- end }}

{{/* BACKFILL_FLEET_URLS: the deployments' frontend base URLs, comma-separated. */}}
{{- define "backfill.fleetUrls" -}}
{{- $urls := list }}
{{- range .Values.fleet.deployments }}
{{- $url := required (printf "fleet.deployments[%s].frontendUrl is required" (toString .name)) .frontendUrl }}
{{- $urls = append $urls (trimSuffix "/" $url) }}
{{- end }}
{{- join "," $urls }}
{{- end }}

{{/* BACKFILL_FLEET_METRICS_URLS: `role=url,...` per deployment, deployments joined by `;`.
Empty when no deployment lists its metrics endpoints (the app then reads each frontend's
/metrics); a deployment without a list gets its frontend's, as the app would derive it. */}}
{{- define "backfill.fleetMetricsUrls" -}}
{{- $listed := false }}
{{- range .Values.fleet.deployments }}{{ if .metrics }}{{ $listed = true }}{{ end }}{{ end }}
{{- if $listed }}
{{- $deployments := list }}
{{- range .Values.fleet.deployments }}
{{- $items := list }}
{{- if .metrics }}
{{- range .metrics }}
{{- if not (has .role (list "frontend" "agg" "prefill" "decode")) }}
{{- fail (printf "fleet metrics role %q: use frontend, agg, prefill or decode" (toString .role)) }}
{{- end }}
{{- $items = append $items (printf "%s=%s" .role (required "fleet metrics entries need a url" .url)) }}
{{- end }}
{{- else }}
{{- $items = append $items (printf "frontend=%s/metrics" (trimSuffix "/v1" (trimSuffix "/" .frontendUrl))) }}
{{- end }}
{{- $deployments = append $deployments (join "," $items) }}
{{- end }}
{{- join ";" $deployments }}
{{- end }}
{{- end }}

{{/* The worker's grace period: above the drain's own. */}}
{{- define "backfill.workerTerminationGrace" -}}
{{- $drain := int .Values.worker.drainGraceSeconds }}
{{- $grace := int .Values.worker.terminationGracePeriodSeconds }}
{{- if not $grace }}
{{- $grace = add $drain (int .Values.worker.terminationGraceMarginSeconds) }}
{{- end }}
{{- if le $grace $drain }}
{{- fail (printf "worker.terminationGracePeriodSeconds (%d) must be above worker.drainGraceSeconds (%d)" $grace $drain) }}
{{- end }}
{{- $grace }}
{{- end }}

{{/* Checksums that roll the pods when their configuration changes. */}}
{{- define "backfill.configChecksums" -}}
checksum/config: {{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
{{- if not .Values.secrets.existingSecret }}
checksum/secret: {{ toYaml .Values.secrets | sha256sum }}
{{- end }}
{{- end }}

{{/* Environment of every backfill container: settings from the ConfigMap, secrets by key. */}}
{{- define "backfill.envFrom" -}}
- configMapRef:
    name: {{ include "backfill.configName" . }}
{{- end }}

{{/* Secret-backed variables, by component: only the API reads the configured keys and the
metrics token, only the workers (the drains) the overflow's key. Call with (dict "ctx" $ "component" "api"). */}}
{{- define "backfill.secretEnv" -}}
{{- $secret := include "backfill.secretName" .ctx }}
{{- $required := list "BACKFILL_DATABASE_URL" "BACKFILL_BROKER_URL" }}
{{- $optional := list "BACKFILL_REDIS_URL" "BACKFILL_S3_ACCESS_KEY" "BACKFILL_S3_SECRET_KEY" "BACKFILL_FLEET_API_KEY" }}
{{- if eq .component "worker" }}
{{- $optional = append $optional "BACKFILL_OVERFLOW_API_KEY" }}
{{- end }}
{{- if eq .component "api" }}
{{- $optional = concat $optional (list "BACKFILL_BOOTSTRAP_API_KEY" "BACKFILL_ADMIN_API_KEY") }}
{{- if .ctx.Values.metrics.token.enabled }}
{{- $required = append $required "BACKFILL_METRICS_TOKEN" }}
{{- end }}
{{- end }}
{{- range $required }}
- name: {{ . }}
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ . }}
{{- end }}
{{- range $optional }}
- name: {{ . }}
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ . }}
      optional: true
{{- end }}
{{- with .ctx.Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Volumes and mounts every backfill pod has: the metrics directory and a writable /tmp
(the root filesystem is read-only). */}}
{{- define "backfill.volumes" -}}
- name: metrics
{{- if .Values.metrics.sharedClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.metrics.sharedClaim }}
{{- else }}
  emptyDir:
    medium: Memory
    sizeLimit: 64Mi
{{- end }}
- name: tmp
  emptyDir: {}
{{- end }}

{{- define "backfill.volumeMounts" -}}
- name: metrics
  mountPath: {{ .Values.metrics.dir }}
- name: tmp
  mountPath: /tmp
{{- end }}

{{/* Pod-level fields shared by the Deployments. Call with (dict "ctx" $ "values" .Values.api). */}}
{{- define "backfill.podScheduling" -}}
{{- with .values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "backfill.podCommon" -}}
serviceAccountName: {{ include "backfill.serviceAccountName" . }}
automountServiceAccountToken: false
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* KEDA's view of the broker's Redis: explicit worker.autoscaling.redis values, else what
secrets.brokerUrl says (redis[s]://[[user]:password@]host[:port][/db]). */}}
{{- define "backfill.brokerUrlParts" -}}
{{- $r := .Values.worker.autoscaling.redis }}
{{- $parts := dict "address" $r.address "db" (toString $r.databaseIndex) "tls" (toString $r.enableTLS) "user" "" "password" "" }}
{{- if and (not $r.address) .Values.secrets.existingSecret }}
{{- fail "worker.autoscaling.redis.address is required with secrets.existingSecret (KEDA cannot read the broker URL from it)" }}
{{- end }}
{{- if not .Values.secrets.existingSecret }}
{{- $u := urlParse (required "secrets.brokerUrl is required" .Values.secrets.brokerUrl) }}
{{- if not (has $u.scheme (list "redis" "rediss")) }}
{{- fail (printf "KEDA scales the workers on Redis lists: the broker URL's scheme is %q" $u.scheme) }}
{{- end }}
{{- if not $r.address }}
{{- $host := $u.host }}
{{- if not (regexMatch ":[0-9]+$" $host) }}{{ $host = printf "%s:6379" $host }}{{ end }}
{{- $_ := set $parts "address" $host }}
{{- end }}
{{- if eq (toString $r.databaseIndex) "" }}
{{- $_ := set $parts "db" (default "0" (trimPrefix "/" $u.path)) }}
{{- end }}
{{- if eq (toString $r.enableTLS) "" }}
{{- $_ := set $parts "tls" (ternary "true" "false" (eq $u.scheme "rediss")) }}
{{- end }}
{{- if contains ":" $u.userinfo }}
{{- $_ := set $parts "user" (first (splitList ":" $u.userinfo)) }}
{{- $_ := set $parts "password" (join ":" (rest (splitList ":" $u.userinfo))) }}
{{- end }}
{{- end }}
{{- if eq $parts.db "" }}{{ $_ := set $parts "db" "0" }}{{ end }}
{{- if eq $parts.tls "" }}{{ $_ := set $parts "tls" "false" }}{{ end }}
{{- toYaml $parts }}
{{- end }}

{{/* The broker URL's password (and user) for KEDA, when the chart writes the Secret. */}}
{{- define "backfill.kedaRedisPassword" -}}
{{- if and .Values.worker.autoscaling.enabled (not .Values.worker.autoscaling.redis.passwordSecret.name) (not .Values.secrets.existingSecret) }}
{{- (include "backfill.brokerUrlParts" . | fromYaml).password }}
{{- end }}
{{- end }}

{{- define "backfill.kedaRedisUser" -}}
{{- if include "backfill.kedaRedisPassword" . }}
{{- (include "backfill.brokerUrlParts" . | fromYaml).user }}
{{- end }}
{{- end }}
