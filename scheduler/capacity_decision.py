"""What the capacity controller decided for one period: the law's output (`scheduler.capacity_law`),
published by its loop (`scheduler.capacity`) and recorded as metrics (`scheduler.metrics`).

Its own module so that the law and the metrics both name it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Decision:
    limit: int
    shed_to: int | None
    reason: str
    interactive: int = 0
    batch: int = 0
    itl_s: float | None = None
    ttft_s: float | None = None
    kv_usage: float = 0.0
    cap: int = 0
    idle: bool = False
