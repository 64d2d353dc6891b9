"""`GET /v1/models`: what the fleet serves, so a client knows what to put in its lines."""

from __future__ import annotations

from fastapi import APIRouter

from backfill.api.deps import CurrentPrincipal
from backfill.api.errors import COMMON_ERRORS, error_responses
from backfill.api.protocol import Model, ModelList
from backfill.jobs.errors import NotFound
from backfill.storage.fleet_models import get_catalog

router = APIRouter(prefix="/v1/models", tags=["models"], responses=error_responses(*COMMON_ERRORS, 503))


def _served() -> list[Model]:
    return [Model.model_validate(m) for m in get_catalog().models()]


@router.get("")
def list_models(_: CurrentPrincipal) -> ModelList:
    return ModelList(object="list", data=_served())


@router.get("/{model_id:path}")
def retrieve_model(model_id: str, _: CurrentPrincipal) -> Model:
    for model in _served():
        if model.id == model_id:
            return model
    raise NotFound(f"The model '{model_id}' does not exist", param="model", code="model_not_found")
