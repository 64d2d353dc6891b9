"""Teams and API keys. Keys are shown once, stored as a SHA-256 hash, found by hash."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from backfill.jobs.errors import Conflict, NotFound, Unauthorized
from backfill.jobs.models import ApiKey, Team, utcnow

KEY_PREFIX = "sk-bf-"


@dataclass(frozen=True)
class Principal:
    team_id: str
    team_name: str
    key_id: str
    is_admin: bool


def hash_key(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


def visible_prefix(raw: str) -> str:
    return raw[: len(KEY_PREFIX) + 6]


def authenticate(session: Session, raw_key: str | None) -> Principal:
    if not raw_key:
        raise Unauthorized("You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'.")
    digest = hash_key(raw_key)
    row = session.execute(
        select(ApiKey, Team).join(Team, Team.id == ApiKey.team_id).where(ApiKey.key_hash == digest)
    ).first()
    # The lookup is by hash; compare again in constant time so timing never tells how close a guess was.
    if row is None or not hmac.compare_digest(row[0].key_hash, digest) or row[0].revoked_at is not None:
        raise Unauthorized(f"Incorrect API key provided: {visible_prefix(raw_key)}****.")
    key, team = row
    return Principal(team_id=team.id, team_name=team.name, key_id=key.id, is_admin=key.is_admin)


def key_digest_is_live(session: Session, digest: str) -> bool:
    """Whether a key with this digest exists and is not revoked: one indexed lookup, for the
    API's failed-authentication limit (which must never refuse a valid key for its address)."""
    found = session.execute(
        select(ApiKey.key_hash).where(ApiKey.key_hash == digest, ApiKey.revoked_at.is_(None))
    ).scalar_one_or_none()
    return found is not None and hmac.compare_digest(found, digest)


def get_or_create_team(session: Session, *, name: str) -> Team:
    team = session.execute(select(Team).where(Team.name == name)).scalar_one_or_none()
    if team is None:
        team = Team(name=name)
        session.add(team)
        session.flush()
    return team


def create_team(session: Session, *, name: str, weight: int = 1) -> Team:
    if session.execute(select(Team).where(Team.name == name)).scalar_one_or_none() is not None:
        raise Conflict(f"team {name!r} already exists", param="name", code="team_exists")
    team = Team(name=name, weight=weight)
    session.add(team)
    session.flush()
    return team


def find_team(session: Session, *, name_or_id: str) -> Team:
    team = session.execute(select(Team).where((Team.name == name_or_id) | (Team.id == name_or_id))).scalar_one_or_none()
    if team is None:
        raise NotFound(f"No team named {name_or_id!r}", param="team")
    return team


def create_key(session: Session, *, team_id: str, name: str = "", is_admin: bool = False) -> tuple[ApiKey, str]:
    """Returns the row and the raw key; the raw key is never stored."""
    raw = KEY_PREFIX + secrets.token_urlsafe(32)
    key = ApiKey(team_id=team_id, name=name, prefix=visible_prefix(raw), key_hash=hash_key(raw), is_admin=is_admin)
    session.add(key)
    session.flush()
    return key, raw


CONFIGURED_BOOTSTRAP = "configured bootstrap"
CONFIGURED_ADMIN = "configured admin"
ROTATED = "rotated"  # revoked because another key was configured: configuring it again restores it
REVOKED = "revoked"  # revoked by an admin: never undone by a configuration


class ConfiguredKeyRefused(Exception):
    """The configuration names a key an admin revoked. Start-up stops rather than serve a key
    that every request would be refused with (or quietly undo a revocation, e.g. of a leak)."""


def ensure_key(session: Session, *, team_name: str, raw_key: str, is_admin: bool = False) -> None:
    """Make `raw_key` the team's one configured key of its kind (bootstrap or admin), idempotently.

    Configured keys are marked by `ApiKey.configured`, never found by name (an admin may name any
    key "configured"), and rotation stays in the team: installing a new value revokes the team's
    previous configured key of that kind; an empty `raw_key` (the variable unset) revokes it and
    installs none. A key rotation revoked is restored when configured again (A, B, A: A works),
    since the configuration revoked it; one an admin revoked raises ConfiguredKeyRefused."""
    if not raw_key:
        team = session.execute(select(Team).where(Team.name == team_name)).scalar_one_or_none()
        if team is not None:
            _rotate_out(session, team_id=team.id, is_admin=is_admin, keep_hash=None)
        session.flush()
        return
    team = get_or_create_team(session, name=team_name)
    digest = hash_key(raw_key)
    existing = session.execute(select(ApiKey).where(ApiKey.key_hash == digest)).scalar_one_or_none()
    if existing is not None and existing.revoked_at is not None and existing.revoked_reason != ROTATED:
        variable = "BACKFILL_ADMIN_API_KEY" if is_admin else "BACKFILL_BOOTSTRAP_API_KEY"
        raise ConfiguredKeyRefused(
            f"{variable} ({visible_prefix(raw_key)}****) was revoked by an admin on "
            f"{existing.revoked_at:%Y-%m-%d %H:%M} UTC; a revoked key is not restored by configuring it "
            f"again: configure a new key in {variable}"
            + (" (or leave it unset and delete the home's bootstrap_key file)" if not is_admin else "")
        )
    if existing is not None and (existing.team_id != team.id or existing.is_admin != is_admin):
        raise ConfiguredKeyRefused(
            f"the key configured for team {team_name!r} ({visible_prefix(raw_key)}****) already exists as "
            f"another team's or kind's key; configure a new key"
        )
    _rotate_out(session, team_id=team.id, is_admin=is_admin, keep_hash=digest)
    if existing is None:
        name = CONFIGURED_ADMIN if is_admin else CONFIGURED_BOOTSTRAP
        session.add(
            ApiKey(
                team_id=team.id,
                name=name,
                prefix=visible_prefix(raw_key),
                key_hash=digest,
                is_admin=is_admin,
                configured=True,
            )
        )
    else:
        existing.configured = True
        existing.revoked_at = existing.revoked_reason = None  # only ever a rotated key here
    session.flush()


def _rotate_out(session: Session, *, team_id: str, is_admin: bool, keep_hash: str | None) -> None:
    """Revoke the team's configured keys of this kind other than `keep_hash`, as rotated."""
    query = update(ApiKey).where(
        ApiKey.team_id == team_id,
        ApiKey.configured.is_(True),
        ApiKey.is_admin == is_admin,
        ApiKey.revoked_at.is_(None),
    )
    if keep_hash is not None:
        query = query.where(ApiKey.key_hash != keep_hash)
    session.execute(
        query.values(revoked_at=utcnow(), revoked_reason=ROTATED).execution_options(synchronize_session=False)
    )


def list_teams(session: Session) -> list[Team]:
    return list(session.execute(select(Team).order_by(Team.created_at, Team.id)).scalars())


def get_team(session: Session, *, team_id: str) -> Team:
    team = session.get(Team, team_id)
    if team is None:
        raise NotFound(f"No project found with id '{team_id}'.", param="project_id")
    return team


def list_keys(session: Session, *, team_id: str | None = None) -> list[ApiKey]:
    query = select(ApiKey).order_by(ApiKey.created_at, ApiKey.id)
    if team_id is not None:
        query = query.where(ApiKey.team_id == team_id)
    return list(session.execute(query).scalars())


def revoke_key(session: Session, *, key_id_or_prefix: str, team_id: str | None = None) -> ApiKey:
    """Revoke by id or visible prefix; `team_id` confines the search to one team. Idempotent."""
    query = select(ApiKey).where((ApiKey.id == key_id_or_prefix) | (ApiKey.prefix == key_id_or_prefix))
    if team_id is not None:
        query = query.where(ApiKey.team_id == team_id)
    keys = list(session.execute(query.limit(2)).scalars())
    if not keys:
        raise NotFound(f"No API key {key_id_or_prefix!r}", param="key")
    if len(keys) > 1:
        raise Conflict(f"More than one key matches {key_id_or_prefix!r}; revoke it by id.", param="key")
    key = keys[0]
    if key.revoked_at is None or key.revoked_reason == ROTATED:  # by hand now: never restored
        key.revoked_at = key.revoked_at or utcnow()
        key.revoked_reason = REVOKED
    session.flush()
    return key


def team_weights(session: Session, *, team_ids: set[str]) -> dict[str, float]:
    """Fair-share weights of the given teams."""
    if not team_ids:
        return {}
    rows = session.execute(select(Team.id, Team.weight).where(Team.id.in_(team_ids)))
    return {team_id: float(weight) for team_id, weight in rows}
