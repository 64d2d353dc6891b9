"""Bearer-key authentication: every route but /health needs a key."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from jobs.errors import Forbidden
from jobs.teams import Principal, authenticate
from storage.db import unit_of_work


def current_principal(request: Request) -> Principal:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    raw = token.strip() if scheme.lower() == "bearer" else ""
    with unit_of_work() as session:
        return authenticate(session, raw or None)


def admin_principal(principal: Annotated[Principal, Depends(current_principal)]) -> Principal:
    if not principal.is_admin:
        raise Forbidden("This route needs an admin API key.")
    return principal


CurrentPrincipal = Annotated[Principal, Depends(current_principal)]
AdminPrincipal = Annotated[Principal, Depends(admin_principal)]
