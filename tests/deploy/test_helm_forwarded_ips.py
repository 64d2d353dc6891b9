"""The API deployment hands `api.forwardedAllowIps` to the app as BACKFILL_FORWARDED_ALLOW_IPS
(which `backfill api` passes to uvicorn), so behind the ingress each client keeps its own
address; unset, nothing is trusted beyond uvicorn's loopback default."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from backfill.storage.settings import Settings
from tests.deploy.test_helm_chart import PRODUCTION, Rendered, helm_template
from tests.deploy.test_helm_chart import pytestmark as pytestmark  # skipped without helm


def _api_env(tmp: Path, *args: str) -> dict[str, str]:
    result = helm_template(tmp, *args)
    assert result.returncode == 0, result.stderr
    rendered = Rendered([d for d in yaml.safe_load_all(result.stdout) if d])
    _, container = rendered.component("api")
    return rendered.resolved(container)


def test_the_trusted_proxies_reach_the_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = _api_env(tmp_path, "-f", str(PRODUCTION), "--set", "api.forwardedAllowIps=10.244.0.0/16\\,192.0.2.7")
    assert env["BACKFILL_FORWARDED_ALLOW_IPS"] == "10.244.0.0/16,192.0.2.7"
    monkeypatch.setenv("BACKFILL_FORWARDED_ALLOW_IPS", env["BACKFILL_FORWARDED_ALLOW_IPS"])
    assert Settings(_env_file=None).forwarded_allow_ips == "10.244.0.0/16,192.0.2.7"  # type: ignore[call-arg]


def test_no_proxy_is_trusted_unless_configured(tmp_path: Path) -> None:
    assert "BACKFILL_FORWARDED_ALLOW_IPS" not in _api_env(tmp_path)
    # The production values name an ingress's pod range (with NetworkPolicy on, the chart refuses
    # to render without one): only that range is trusted.
    assert _api_env(tmp_path, "-f", str(PRODUCTION))["BACKFILL_FORWARDED_ALLOW_IPS"] == "10.244.0.0/16"
