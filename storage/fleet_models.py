"""The models the fleet serves, asked of the fleet and cached briefly."""

from __future__ import annotations

import time
from typing import Any

import httpx

from backfill.storage.settings import get_settings


class FleetUnavailable(Exception):
    pass


class ModelCatalog:
    def __init__(self, urls: list[str], *, ttl_s: float, api_key: str = "") -> None:
        self._urls = urls
        self._ttl = ttl_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._cached: tuple[float, list[dict[str, Any]]] | None = None

    def models(self) -> list[dict[str, Any]]:
        """Union of `/v1/models` over the fleet's base URLs; raises FleetUnavailable if none answer."""
        now = time.monotonic()
        if self._cached and now - self._cached[0] < self._ttl:
            return self._cached[1]
        seen: dict[str, dict[str, Any]] = {}
        answered = False
        for url in self._urls:
            try:
                resp = httpx.get(f"{url}/models", headers=self._headers, timeout=5.0)
                resp.raise_for_status()
                answered = True
                for m in resp.json().get("data", []):
                    if isinstance(m, dict) and isinstance(m.get("id"), str):
                        seen.setdefault(m["id"], m)
            except (httpx.HTTPError, ValueError):
                continue
        if not answered:
            raise FleetUnavailable(f"no fleet endpoint answered /models ({', '.join(self._urls) or 'none configured'})")
        data = [
            {
                "id": m["id"],
                "object": "model",
                "created": int(m.get("created") or 0),
                "owned_by": str(m.get("owned_by") or "backfill"),
            }
            for m in seen.values()
        ]
        self._cached = (now, data)
        return data

    def model_ids(self) -> set[str]:
        return {m["id"] for m in self.models()}


_catalog: ModelCatalog | None = None


def get_catalog() -> ModelCatalog:
    global _catalog
    if _catalog is None:
        s = get_settings()
        _catalog = ModelCatalog(s.fleet_urls, ttl_s=s.models_cache_s, api_key=s.fleet_api_key)
    return _catalog
