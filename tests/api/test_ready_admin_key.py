"""/ready tells why a dependency failed to the configured admin key only: it never looks a
bearer token up in the database (the probe is exempt from the rate limits, and with the
database down every lookup would hold a thread past its timeout)."""

from __future__ import annotations

import pytest

from backfill.api.wire import project_id_in
from backfill.jobs.teams import authenticate, create_key
from backfill.storage.db import unit_of_work
from backfill.storage.process_state import reset as reset_process_state
from tests.api.conftest import ApiEnv, CheckedClient, Team


def test_only_the_configured_admin_key_reads_the_errors_and_nothing_is_looked_up(
    api: CheckedClient, api_env: ApiEnv, team: Team, monkeypatch: pytest.MonkeyPatch
) -> None:
    with unit_of_work() as session:
        _, database_admin = create_key(session, team_id=project_id_in(team.project_id), is_admin=True)
    lookups: list[str | None] = []

    def counted(session: object, raw_key: str | None) -> object:
        lookups.append(raw_key)
        return authenticate(session, raw_key)  # type: ignore[arg-type]

    # Wherever /ready might look a key up: the module's own name and the source.
    monkeypatch.setattr("backfill.jobs.teams.authenticate", counted)
    monkeypatch.setattr("backfill.api.routes.ops.authenticate", counted, raising=False)
    monkeypatch.setenv("BACKFILL_BROKER_URL", "redis://svc-user:hunter2-secret@127.0.0.1:9/0")
    reset_process_state()
    try:
        as_database_admin = api.get("/ready", headers={"Authorization": f"Bearer {database_admin}"})
        as_configured_admin = api.get("/ready", headers={"Authorization": f"Bearer {api_env.admin_key}"})
        made_up = api.get("/ready", headers={"Authorization": "Bearer sk-made-up-0000"})
    finally:
        monkeypatch.undo()
        reset_process_state()
    assert as_database_admin.status_code == 503
    assert as_database_admin.json()["checks"]["broker"]["error"] is None, as_database_admin.text
    assert made_up.json()["checks"]["broker"]["error"] is None
    assert as_configured_admin.json()["checks"]["broker"]["error"], as_configured_admin.text
    assert lookups == []
