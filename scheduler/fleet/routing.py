"""Which deployments a batch line may go to: those that serve its model.

A snapshot of what each deployment serves (`storage.fleet_models`: its own `/v1/models`, or the
configured map), taken by the drain between claims and read without I/O by everything that
routes a line: the lease pools (`scheduler.capacity.admission.Pool`), the claims, the fleet
client's failover. A deployment never known (it has not answered `/v1/models` since the process
started, and the map does not name it) is taken to serve every model (sending it nothing would
stop a fleet whose `/v1/models` is unreachable): its breaker is what stops lines from going to a
deployment that is down.

A deployment that serves several models gets a lease pool per model, so one model's saturation
or failure never holds back another's batch work; one that serves a single model keeps one pool
under the deployment's plain name, so a one-model fleet has one pool per deployment.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("backfill.routing")

Lookup = Callable[[str], "frozenset[str] | None"]


@dataclass(frozen=True)
class Pool:
    """A lease pool: a deployment (by its index in the fleet client's order: the fleet's
    deployments, then the overflow ones), for one model when it serves several."""

    deployment: int
    model: str | None = None


class FleetRoutes:
    def __init__(self, urls: list[str], lookup: Lookup | None = None, *, refresh_s: float = 5.0) -> None:
        """`urls`: every deployment in the fleet client's order; `lookup(url)`: the models it
        serves, None if unknown (`ModelCatalog.served_by`; None: every deployment serves all)."""
        self.urls = urls
        self._lookup = lookup
        self._refresh_s = refresh_s
        self._at: float | None = None
        self._served: list[frozenset[str] | None] = [None] * len(urls)

    def refresh(self, *, force: bool = False) -> None:
        """Ask the catalog again (it caches each deployment's answer itself); blocking I/O, so a
        drain calls it off its loop."""
        if self._lookup is None:
            return
        now = time.monotonic()
        if not force and self._at is not None and now - self._at < self._refresh_s:
            return
        served = []
        for url in self.urls:
            try:
                served.append(self._lookup(url))
            except Exception:
                log.warning("models of %s could not be read", url, exc_info=True)
                served.append(self._served[len(served)])
        if served != self._served:
            log.info(
                "deployments' models: %s", {u: sorted(m) if m else m for u, m in zip(self.urls, served, strict=True)}
            )
        self._served, self._at = served, now

    def models_of(self, deployment: int) -> frozenset[str] | None:
        return self._served[deployment] if deployment < len(self._served) else None

    def serves(self, deployment: int, model: str | None) -> bool:
        served = self.models_of(deployment)
        return served is None or model is None or model in served

    def pool(self, deployment: int, model: str | None) -> Pool:
        """The pool a line of `model` takes on `deployment`."""
        served = self.models_of(deployment)
        return Pool(deployment, model if served is not None and len(served) > 1 else None)

    def pools(self, deployments: range, models: set[str | None]) -> list[Pool]:
        """The pools among `deployments` that may take lines of `models` (None: a batch whose
        model is not known, which any deployment may take)."""
        out: list[Pool] = []
        for d in deployments:
            for m in sorted(models, key=lambda m: m or ""):
                if self.serves(d, m):
                    p = self.pool(d, m)
                    if p not in out:
                        out.append(p)
        return out

    def claimable(self, pool: Pool) -> frozenset[str] | None:
        """The models whose lines a lease of `pool` may carry (None: any)."""
        return frozenset({pool.model}) if pool.model is not None else self.models_of(pool.deployment)
