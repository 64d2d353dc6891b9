"""Configured keys: one of each kind, rotation revokes the previous one; production by default."""

from __future__ import annotations

import pytest
from sqlalchemy.orm import Session, sessionmaker

from backfill.jobs.errors import Unauthorized
from backfill.jobs.teams import (
    ConfiguredKeyRefused,
    authenticate,
    create_key,
    ensure_key,
    get_or_create_team,
    list_teams,
    revoke_key,
    visible_prefix,
)
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


def test_rotation_stays_in_its_team_and_keeps_keys_merely_named_configured(db: sessionmaker[Session]) -> None:
    """A key's name is free text in the admin API: a team whose admin names a key "configured"
    keeps it when the configured keys rotate; so does one named so by hand in the same team."""
    with db.begin() as s:
        ensure_key(s, team_name="default", raw_key="sk-boot-" + "a" * 32)
        ensure_key(s, team_name="admin", raw_key="sk-admin-" + "a" * 32, is_admin=True)
        other = get_or_create_team(s, name="acme").id
        _, acme_key = create_key(s, team_id=other, name="configured")
        _, acme_admin = create_key(s, team_id=other, name="configured admin", is_admin=True)
        default = get_or_create_team(s, name="default").id
        _, by_hand = create_key(s, team_id=default, name="configured bootstrap")
    with db.begin() as s:  # both configured keys rotate
        ensure_key(s, team_name="default", raw_key="sk-boot-" + "b" * 32)
        ensure_key(s, team_name="admin", raw_key="sk-admin-" + "b" * 32, is_admin=True)
    with db.begin() as s:
        assert _works(s, acme_key) and _works(s, acme_admin) and _works(s, by_hand)
        assert not _works(s, "sk-boot-" + "a" * 32) and _works(s, "sk-boot-" + "b" * 32)


def test_unsetting_a_configured_key_revokes_it(db: sessionmaker[Session]) -> None:
    boot, admin = "sk-boot-" + "a" * 32, "sk-admin-" + "a" * 32
    with db.begin() as s:
        ensure_key(s, team_name="default", raw_key=boot)
        ensure_key(s, team_name="admin", raw_key=admin, is_admin=True)
    with db.begin() as s:  # restarted with BACKFILL_BOOTSTRAP_API_KEY unset
        ensure_key(s, team_name="default", raw_key="")
        ensure_key(s, team_name="admin", raw_key=admin, is_admin=True)
    with db.begin() as s:
        assert not _works(s, boot) and _works(s, admin)
    with db.begin() as s:  # unset in a database that never had one: nothing to do, no team made
        ensure_key(s, team_name="nobody", raw_key="")
        assert all(t.name != "nobody" for t in list_teams(s))


def test_a_key_configured_again_after_rotation_works_again(db: sessionmaker[Session]) -> None:
    """A, then B (revokes A), then A again: A is the configured key again and works; B is revoked.
    Rotation revoked A only because it was no longer configured; configuring it restores it."""
    a, b = "sk-boot-" + "a" * 32, "sk-boot-" + "b" * 32
    for raw in (a, b, a):
        with db.begin() as s:
            ensure_key(s, team_name="default", raw_key=raw)
    with db.begin() as s:
        assert _works(s, a) and not _works(s, b)


def test_a_configured_key_an_admin_revoked_is_refused_with_a_clear_message(db: sessionmaker[Session]) -> None:
    """A revocation by hand (a leaked key) is never undone by a configuration that still names the
    key: start-up stops and says which variable holds the revoked key."""
    a = "sk-boot-" + "a" * 32
    with db.begin() as s:
        ensure_key(s, team_name="default", raw_key=a)
        revoke_key(s, key_id_or_prefix=visible_prefix(a))
    with db.begin() as s, pytest.raises(ConfiguredKeyRefused, match="revoked by an admin"):
        ensure_key(s, team_name="default", raw_key=a)
    with db.begin() as s:
        assert not _works(s, a)
