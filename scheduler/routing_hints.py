"""Routing hints backfill adds to a batch line's body on its way to the fleet, so the fleet
serves it behind interactive traffic. Nothing else of the client's body is touched."""

from __future__ import annotations

from typing import Any


def add_routing_hints(body: dict[str, Any], mode: str) -> dict[str, Any]:
    """`nvext`: Dynamo's agent hints (a low priority); `vllm`: vLLM's priority (a larger value is
    served later); anything else: the body as it is."""
    if mode == "nvext":
        nvext = dict(body.get("nvext") or {})
        hints = dict(nvext.get("agent_hints") or {})
        hints.setdefault("priority", -10)
        nvext["agent_hints"] = hints
        return {**body, "nvext": nvext}
    if mode == "vllm":
        return {**body, "priority": body.get("priority", 10)}
    return body
