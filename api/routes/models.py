"""`GET /v1/models`: what the fleet serves, so a client knows what to put in its lines."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from api.auth import CurrentPrincipal
from jobs.catalog import get_catalog
from jobs.errors import NotFound

router = APIRouter(prefix="/v1/models", tags=["models"])


@router.get("")
def list_models(_: CurrentPrincipal) -> dict[str, Any]:
    return {"object": "list", "data": get_catalog().models()}


@router.get("/{model_id:path}")
def retrieve_model(model_id: str, _: CurrentPrincipal) -> dict[str, Any]:
    for model in get_catalog().models():
        if model["id"] == model_id:
            return model
    raise NotFound(f"The model '{model_id}' does not exist", param="model", code="model_not_found")
