"""FastAPI dependencies, in one place: the request's unit of work, the object store, the caller."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from backfill.jobs.errors import Forbidden
from backfill.jobs.teams import Principal, authenticate
from backfill.storage.db import unit_of_work
from backfill.storage.objects import ObjectStore, get_object_store


def db_session() -> Iterator[Session]:
    """One unit of work per request: services flush, this commits (or rolls back on an error)."""
    with unit_of_work() as session:
        yield session


# scope="function": FastAPI ends the unit of work as soon as the endpoint returns, before the
# response is sent, so a client that got its 200 finds the row committed; and a failed commit
# answers with an error instead of a 200 for nothing. No connection is taken until the first query.
DbSession = Annotated[Session, Depends(db_session, scope="function")]


def object_store() -> ObjectStore:
    return get_object_store()


Store = Annotated[ObjectStore, Depends(object_store)]


def current_principal(request: Request) -> Principal:
    """Every route but /health needs a bearer key. The key is checked in its own short
    transaction, apart from the route's, so a long upload never holds one open."""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    raw = token.strip() if scheme.lower() == "bearer" else ""
    with unit_of_work() as session:
        principal = authenticate(session, raw or None)
    request.state.team_id = principal.team_id  # for the access log (never the key)
    return principal


CurrentPrincipal = Annotated[Principal, Depends(current_principal)]


def admin_principal(principal: CurrentPrincipal) -> Principal:
    if not principal.is_admin:
        raise Forbidden("This route needs an admin API key.")
    return principal


AdminPrincipal = Annotated[Principal, Depends(admin_principal)]
