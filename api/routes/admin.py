"""Admin-key-only administration: projects (teams), their API keys, prices and quotas.

The same services back the `backfill teams|keys|prices|quotas` commands.
"""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from backfill.api.deps import AdminPrincipal, DbSession
from backfill.api.errors import COMMON_ERRORS, error_responses
from backfill.api.protocol import (
    CreatedProjectApiKey,
    Price,
    PriceList,
    Project,
    ProjectApiKeyDeleted,
    ProjectApiKeyList,
    ProjectList,
    Quota,
    QuotaList,
)
from backfill.api.wire import (
    created_key_out,
    from_unix,
    key_deleted_out,
    key_id_in,
    key_out,
    price_out,
    price_page,
    project_id_in,
    project_out,
    quota_out,
)
from backfill.jobs import teams
from backfill.jobs.billing import ledger as billing
from backfill.jobs.billing import quotas
from backfill.jobs.errors import InvalidRequest
from backfill.storage.settings import parse_duration

router = APIRouter(prefix="/v1/organization", tags=["admin"], responses=error_responses(*COMMON_ERRORS, 403))


class CreateProjectBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=128)
    weight: int = Field(default=1, ge=1)


class CreateKeyBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(default="", max_length=128)
    admin: bool = False


class SetPriceBody(BaseModel):
    """Prices per million tokens in currency units, as decimal strings or numbers."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1, max_length=256)
    input: str | int | float
    cached_input: str | int | float
    output: str | int | float
    batch_discount_percent: int = billing.DEFAULT_BATCH_DISCOUNT_PERCENT
    completion_window: str | None = None
    effective_from: int | None = None


class SetQuotaBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1, max_length=256)
    max_enqueued_tokens: int | None = None
    max_concurrent_batches: int | None = None


@router.post("/projects")
def create_project(body: CreateProjectBody, _: AdminPrincipal, session: DbSession) -> Project:
    return project_out(teams.create_team(session, name=body.name, weight=body.weight))


@router.get("/projects")
def list_projects(_: AdminPrincipal, session: DbSession) -> ProjectList:
    return ProjectList.of([project_out(t) for t in teams.list_teams(session)])


@router.get("/projects/{project_id}")
def retrieve_project(project_id: str, _: AdminPrincipal, session: DbSession) -> Project:
    return project_out(teams.get_team(session, team_id=project_id_in(project_id)))


@router.post("/projects/{project_id}/api_keys")
def create_key(project_id: str, body: CreateKeyBody, _: AdminPrincipal, session: DbSession) -> CreatedProjectApiKey:
    team = teams.get_team(session, team_id=project_id_in(project_id))
    key, raw = teams.create_key(session, team_id=team.id, name=body.name, is_admin=body.admin)
    return created_key_out(key, raw=raw)


@router.get("/projects/{project_id}/api_keys")
def list_keys(project_id: str, _: AdminPrincipal, session: DbSession) -> ProjectApiKeyList:
    team = teams.get_team(session, team_id=project_id_in(project_id))
    return ProjectApiKeyList.of([key_out(k) for k in teams.list_keys(session, team_id=team.id)])


@router.delete("/projects/{project_id}/api_keys/{key_id}")
def revoke_key(project_id: str, key_id: str, _: AdminPrincipal, session: DbSession) -> ProjectApiKeyDeleted:
    """Revokes (the row stays, for the audit trail); the key answers 401 from the next request on."""
    team = teams.get_team(session, team_id=project_id_in(project_id))
    return key_deleted_out(teams.revoke_key(session, key_id_or_prefix=key_id_in(key_id), team_id=team.id))


@router.post("/prices")
def set_price(body: SetPriceBody, _: AdminPrincipal, session: DbSession) -> Price:
    if body.completion_window is not None:
        try:
            parse_duration(body.completion_window)
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="completion_window") from None
    price = billing.set_price(
        session,
        model=body.model,
        input_micros=billing.parse_money(body.input, param="input"),
        cached_input_micros=billing.parse_money(body.cached_input, param="cached_input"),
        output_micros=billing.parse_money(body.output, param="output"),
        discount_percent=body.batch_discount_percent,
        completion_window=body.completion_window,
        effective_from=from_unix(body.effective_from, param="effective_from") if body.effective_from else None,
    )
    return price_out(price)


@router.get("/prices")
def list_prices(_: AdminPrincipal, session: DbSession, model: str | None = None) -> PriceList:
    return price_page(billing.list_prices(session, model=model))


@router.post("/projects/{project_id}/quotas")
def set_quota(project_id: str, body: SetQuotaBody, _: AdminPrincipal, session: DbSession) -> Quota:
    team = teams.get_team(session, team_id=project_id_in(project_id))
    quota = quotas.set_quota(
        session,
        team_id=team.id,
        model=body.model,
        max_enqueued_tokens=body.max_enqueued_tokens,
        max_concurrent_batches=body.max_concurrent_batches,
    )
    return quota_out(quota)


@router.get("/projects/{project_id}/quotas")
def list_quotas(project_id: str, _: AdminPrincipal, session: DbSession) -> QuotaList:
    team = teams.get_team(session, team_id=project_id_in(project_id))
    return QuotaList.of([quota_out(q) for q in quotas.list_quotas(session, team_id=team.id)])
