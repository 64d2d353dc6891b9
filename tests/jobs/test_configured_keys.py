"""Configured keys: one of each kind, rotation revokes the previous one; production by default."""

from __future__ import annotations

import pytest
from sqlalchemy.orm import Session, sessionmaker

from backfill.jobs.errors import Unauthorized
from backfill.jobs.teams import authenticate, create_key, ensure_key, get_or_create_team
from backfill.storage.settings import Settings


def _works(session: Session, key: str) -> bool:
    try:
        authenticate(session, key)
        return True
    except Unauthorized:
        return False


def test_rotating_a_configured_key_revokes_the_old_one(db: sessionmaker[Session]) -> None:
    old_admin, new_admin = "sk-admin-" + "a" * 32, "sk-admin-" + "b" * 32
    boot = "sk-boot-" + "c" * 32
    with db.begin() as s:
        ensure_key(s, team_name="admin", raw_key=old_admin, is_admin=True)
        ensure_key(s, team_name="default", raw_key=boot)
        team = get_or_create_team(s, name="admin").id
        _, made_by_hand = create_key(s, team_id=team, name="ops", is_admin=True)
    with db.begin() as s:  # restart with a rotated admin key
        ensure_key(s, team_name="admin", raw_key=new_admin, is_admin=True)
        ensure_key(s, team_name="default", raw_key=boot)
    with db.begin() as s:
        assert not _works(s, old_admin)
        assert _works(s, new_admin)
        assert _works(s, boot)  # the other kind is untouched
        assert _works(s, made_by_hand)  # keys created with `backfill keys create` are not configured keys
    with db.begin() as s:  # the same configuration again changes nothing
        ensure_key(s, team_name="admin", raw_key=new_admin, is_admin=True)
    with db.begin() as s:
        assert _works(s, new_admin) and not _works(s, old_admin)


def test_environment_defaults_to_production_and_refuses_development_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BACKFILL_ENVIRONMENT", raising=False)
    monkeypatch.setenv("BACKFILL_BOOTSTRAP_API_KEY", "sk-dev-0123456789abcdefghij")
    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    assert settings.environment == "production"
    with pytest.raises(ValueError, match="development secret"):
        settings.check_production()
