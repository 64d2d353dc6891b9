"""The models the fleet serves, deployment by deployment: each deployment's own `/v1/models`,
asked and cached briefly, unless the configured map (`BACKFILL_FLEET_MODELS`) says for it.

What one deployment serves decides where a batch line may go (`scheduler.fleet.routing`); the
union over the fleet's deployments is what `GET /v1/models` lists and what validation accepts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from backfill.storage.settings import get_settings


class FleetUnavailable(Exception):
    pass


class ModelCatalog:
    def __init__(
        self,
        urls: list[str],
        *,
        ttl_s: float,
        api_key: str = "",
        configured: Mapping[str, Sequence[str]] | None = None,
        keys: Mapping[str, str] | None = None,
    ) -> None:
        """`urls`: the deployments whose union is the fleet's catalog; `configured`: the models of
        deployments that are not asked (by base URL); `keys`: a deployment's own API key where it
        is not `api_key` (an overflow's)."""
        self._urls = urls
        self._ttl = ttl_s
        self._api_key = api_key
        self._keys = dict(keys or {})
        self._configured = {u.rstrip("/"): list(m) for u, m in (configured or {}).items()}
        self._lock = threading.Lock()
        self._asked: dict[str, tuple[float, list[dict[str, Any]]]] = {}  # url -> (when, its /models)

    def _ask(self, url: str) -> list[dict[str, Any]] | None:
        """One deployment's models, from the cache while fresh; None when it does not answer."""
        now = time.monotonic()
        with self._lock:
            cached = self._asked.get(url)
        if cached is not None and now - cached[0] < self._ttl:
            return cached[1]
        key = self._keys.get(url, self._api_key)
        try:
            resp = httpx.get(f"{url}/models", headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=5.0)
            resp.raise_for_status()
            data = [m for m in resp.json().get("data", []) if isinstance(m, dict) and isinstance(m.get("id"), str)]
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        with self._lock:
            self._asked[url] = (now, data)
        return data

    def served_by(self, url: str) -> frozenset[str] | None:
        """The models deployment `url` serves: as configured, else its `/v1/models` (the last
        answer it gave, if it does not answer now); None if it was never known."""
        url = url.rstrip("/")
        if url in self._configured:
            return frozenset(self._configured[url])
        data = self._ask(url)
        if data is None:
            with self._lock:
                last = self._asked.get(url)
            return None if last is None else frozenset(m["id"] for m in last[1])
        return frozenset(m["id"] for m in data)

    def models(self) -> list[dict[str, Any]]:
        """Union over the fleet's deployments; raises FleetUnavailable if none answer."""
        seen: dict[str, dict[str, Any]] = {}
        answered = False
        for url in self._urls:
            if url in self._configured:
                answered = True
                for name in self._configured[url]:
                    seen.setdefault(name, {"id": name})
                continue
            data = self._ask(url)
            if data is None:
                continue
            answered = True
            for m in data:
                seen.setdefault(m["id"], m)
        if not answered:
            raise FleetUnavailable(f"no fleet endpoint answered /models ({', '.join(self._urls) or 'none configured'})")
        return [
            {
                "id": m["id"],
                "object": "model",
                "created": int(m.get("created") or 0),
                "owned_by": str(m.get("owned_by") or "backfill"),
            }
            for m in seen.values()
        ]

    def model_ids(self) -> set[str]:
        return {m["id"] for m in self.models()}


_catalog: ModelCatalog | None = None


def get_catalog() -> ModelCatalog:
    """The process's catalog over the fleet's deployments and its overflow ones (an overflow
    deployment is asked with its own key; it is not part of the union `GET /v1/models` lists)."""
    global _catalog
    if _catalog is None:
        s = get_settings()
        _catalog = ModelCatalog(
            s.fleet_urls,
            ttl_s=s.models_cache_s,
            api_key=s.fleet_api_key,
            configured=s.fleet_models,
            keys=dict.fromkeys(s.overflow_urls, s.overflow_api_key) if s.overflow_api_key else None,
        )
    return _catalog
