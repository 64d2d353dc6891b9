#!/usr/bin/env bash
# Set up everything the tests need, then run lint, types, layer contracts and the tests.
# Needs PostgreSQL on 127.0.0.1:5432 (trust auth) and Redis on 127.0.0.1:6379; installs
# the rest itself: the Python environment, SeaweedFS (S3), and the Dynamo frontend + mocker
# fleet in its own virtualenv with a tiny locally built model.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[dev]'
.venv/bin/python -m backfill.devfleet install
# A real browser for the dashboard's page tests: Debian's Chromium (Playwright cannot download
# its own builds here). Without apt rights everything else still runs; those tests then skip.
# Debian's Prometheus, to run the Grafana dashboard's queries against a real scrape.
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >/dev/null 2>&1 \
    || echo "could not install chromium: the dashboard's browser tests will skip" >&2
fi
if [ ! -x /usr/bin/prometheus ] && command -v apt-get >/dev/null 2>&1; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; } \
    >/dev/null 2>&1 || echo "could not install prometheus: the dashboard query tests will skip" >&2
fi
.venv/bin/ruff check .
.venv/bin/mypy
.venv/bin/lint-imports
# Helm and the Kubernetes 1.37 schemas (under .helm/): lint, render and validate the chart.
bash scripts/helm.sh
.venv/bin/pytest "$@"
