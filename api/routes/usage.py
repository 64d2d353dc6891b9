"""OpenAI's Usage and Costs API over the usage ledger, scoped to the caller's team (project);
an admin key sees every team."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from backfill.api.deps import CurrentPrincipal, DbSession
from backfill.api.errors import COMMON_ERRORS, error_responses
from backfill.api.protocol import (
    Bucket,
    CompletionsUsagePage,
    CompletionsUsageResult,
    CostsPage,
    CostsResult,
)
from backfill.api.wire import PROJECT_PREFIX, amount_out, from_unix, key_id_in, key_id_out, project_id_out, ts
from backfill.jobs.billing.usage import BUCKET_WIDTHS, UsageTotals, align, resolved_end, usage_totals
from backfill.jobs.errors import InvalidRequest
from backfill.jobs.models import utcnow
from backfill.jobs.teams import Principal

router = APIRouter(prefix="/v1/organization", tags=["usage"], responses=error_responses(*COMMON_ERRORS))

# OpenAI's bucket limits per width: (default, maximum).
USAGE_LIMITS = {"1m": (60, 1440), "1h": (24, 168), "1d": (7, 31)}
COSTS_LIMITS = (7, 180)
USAGE_GROUPS = frozenset({"project_id", "api_key_id", "model", "batch"})
COSTS_GROUPS = frozenset({"project_id", "line_item"})
LATEST = datetime(9999, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class Window:
    """One page of buckets: [start, end) on the width's grid, and where the next page starts."""

    start: datetime
    end: datetime
    width_s: int
    next_page: str | None

    def bucket_starts(self) -> list[datetime]:
        n = -(-int((self.end - self.start).total_seconds()) // self.width_s)
        return [self.start + timedelta(seconds=i * self.width_s) for i in range(n)]

    def bucket_end(self, start: datetime) -> int:
        return ts(start + timedelta(seconds=self.width_s))


def _window(start_time: int, end_time: int | None, width_s: int, limit: int, page: str | None) -> Window:
    # Buckets sit on the UTC grid of their width (days start at 00:00 UTC), so a bucket means the
    # same interval whatever start_time a caller picks; the page cursor is the next bucket's start.
    start = align(from_unix(start_time, param="start_time"), width_s)
    end = from_unix(end_time, param="end_time") if end_time is not None else utcnow()
    # Bucket arithmetic adds up to half a year to these: keep every sum a date Python can hold.
    for bound, name in ((start, "start_time"), (end, "end_time")):
        if bound >= LATEST:
            raise InvalidRequest(f"'{name}' must be before {LATEST:%Y-%m-%d} (Unix time {ts(LATEST)}).", param=name)
    if end <= start:
        raise InvalidRequest("'end_time' must be after 'start_time'.", param="end_time")
    # Usage is resolved to the minute (rolled-up ledger rows stand at the start of their
    # minute): the end rounds up to one, so the answer is the same before and after a rollup.
    end = resolved_end(end)
    if page is not None:
        # ASCII digits only: str.isdigit() also says yes to "²", which int() refuses.
        cursor = int(page) if page.isascii() and page.isdigit() and len(page) <= 12 else -1
        moment = from_unix(cursor, param="page") if cursor >= 0 else None
        if moment is None or moment < start or moment >= end or align(moment, width_s) != moment:
            raise InvalidRequest("'page' is not a cursor this query returned.", param="page")
        start = moment
    page_end = min(end, start + timedelta(seconds=limit * width_s))
    return Window(start, page_end, width_s, str(ts(page_end)) if page_end < end else None)


def _values(request: Request, name: str) -> list[str]:
    """A list parameter sent as `name=a&name=b`, `name[]=a` or `name=a,b`."""
    raw = request.query_params.getlist(name) + request.query_params.getlist(name + "[]")
    return [v.strip() for item in raw for v in item.split(",") if v.strip()]


def _groups(request: Request, allowed: frozenset[str]) -> set[str]:
    groups = set(_values(request, "group_by"))
    if unknown := groups - allowed:
        raise InvalidRequest(
            f"Cannot group by {', '.join(sorted(unknown))}: supported are {', '.join(sorted(allowed))}.",
            param="group_by",
        )
    return groups


def _team_scope(principal: Principal, request: Request) -> list[str] | None:
    """Team ids to read: the caller's own team, or for an admin the asked-for teams (None: all)."""
    wanted = [p[len(PROJECT_PREFIX) :] if p.startswith(PROJECT_PREFIX) else p for p in _values(request, "project_ids")]
    if principal.is_admin:
        return wanted or None
    return [principal.team_id] if not wanted or principal.team_id in wanted else []


def _limit(limit: int | None, bounds: tuple[int, int]) -> int:
    default, most = bounds
    if limit is None:
        return default
    if not 1 <= limit <= most:
        raise InvalidRequest(f"'limit' must be between 1 and {most}.", param="limit")
    return limit


def _by_bucket(rows: list[UsageTotals]) -> dict[datetime, list[UsageTotals]]:
    grouped: dict[datetime, list[UsageTotals]] = defaultdict(list)
    for row in rows:
        grouped[row.bucket_start].append(row)
    return grouped


@router.get("/usage/completions")
def usage_completions(
    request: Request,
    principal: CurrentPrincipal,
    session: DbSession,
    start_time: int,
    end_time: int | None = None,
    bucket_width: Annotated[str, Query(pattern="^(1m|1h|1d)$")] = "1d",
    batch: bool | None = None,
    limit: int | None = None,
    page: str | None = None,
) -> CompletionsUsagePage:
    width_s = BUCKET_WIDTHS[bucket_width]
    window = _window(start_time, end_time, width_s, _limit(limit, USAGE_LIMITS[bucket_width]), page)
    groups = _groups(request, USAGE_GROUPS)
    teams = _team_scope(principal, request)
    rows: list[UsageTotals] = []
    if batch is not False:  # every request backfill runs is a batch request
        rows = usage_totals(
            session,
            start=window.start,
            end=window.end,
            width_s=width_s,
            team_ids=teams,
            models=_values(request, "models") or None,
            api_key_ids=[key_id_in(k) for k in _values(request, "api_key_ids")] or None,
            by_team="project_id" in groups,
            by_api_key="api_key_id" in groups,
            by_model="model" in groups,
        )
    grouped = _by_bucket(rows)
    buckets = [
        Bucket[CompletionsUsageResult](
            object="bucket",
            start_time=ts(start),
            end_time=window.bucket_end(start),
            results=[
                CompletionsUsageResult(
                    object="organization.usage.completions.result",
                    input_tokens=r.prompt_tokens,
                    output_tokens=r.completion_tokens,
                    input_cached_tokens=r.cached_tokens,
                    input_audio_tokens=0,
                    output_audio_tokens=0,
                    num_model_requests=r.requests,
                    project_id=project_id_out(r.team_id) if r.team_id is not None else None,
                    user_id=None,
                    api_key_id=key_id_out(r.api_key_id) if r.api_key_id is not None else None,
                    model=r.model,
                    batch=True if "batch" in groups else None,
                )
                for r in grouped.get(start, [])
            ],
        )
        for start in window.bucket_starts()
    ]
    return CompletionsUsagePage(
        object="page", data=buckets, has_more=window.next_page is not None, next_page=window.next_page
    )


_LINE_ITEMS = (
    ("input", "input_cost_micros"),
    ("cached input", "cached_input_cost_micros"),
    ("output", "output_cost_micros"),
)


def _line_item_tokens(row: UsageTotals, kind: str) -> int:
    return {
        "input": row.prompt_tokens - row.cached_tokens,
        "cached input": row.cached_tokens,
        "output": row.completion_tokens,
    }[kind]


# Rendered by Starlette's JSONResponse, not Pydantic's JSON writer: the amount is a float, and
# this keeps its digits as they always were on the wire (Python's repr: 1e-06, not 1e-6).
@router.get("/costs", response_class=JSONResponse)
def costs(
    request: Request,
    principal: CurrentPrincipal,
    session: DbSession,
    start_time: int,
    end_time: int | None = None,
    bucket_width: Annotated[str, Query(pattern="^1d$")] = "1d",
    limit: int | None = None,
    page: str | None = None,
) -> CostsPage:
    width_s = BUCKET_WIDTHS[bucket_width]
    window = _window(start_time, end_time, width_s, _limit(limit, COSTS_LIMITS), page)
    groups = _groups(request, COSTS_GROUPS)
    by_line_item = "line_item" in groups
    rows = usage_totals(
        session,
        start=window.start,
        end=window.end,
        width_s=width_s,
        team_ids=_team_scope(principal, request),
        by_team="project_id" in groups,
        by_model=by_line_item,  # a line item is a model's input, cached input or output
    )
    grouped = _by_bucket(rows)
    buckets = []
    for start in window.bucket_starts():
        results: list[CostsResult] = []
        for r in grouped.get(start, []):
            project = project_id_out(r.team_id) if r.team_id is not None else None
            if not by_line_item:
                results.append(_cost_result(r.cost_micros, None, project))
                continue
            for kind, field in _LINE_ITEMS:
                if _line_item_tokens(r, kind):
                    results.append(_cost_result(getattr(r, field), f"{r.model}, {kind}", project))
        buckets.append(
            Bucket[CostsResult](
                object="bucket", start_time=ts(start), end_time=window.bucket_end(start), results=results
            )
        )
    return CostsPage(object="page", data=buckets, has_more=window.next_page is not None, next_page=window.next_page)


def _cost_result(micros: int, line_item: str | None, project_id: str | None) -> CostsResult:
    return CostsResult(
        object="organization.costs.result", amount=amount_out(micros), line_item=line_item, project_id=project_id
    )
