"""The API in-process (lifespan included) on the real Postgres and Redis, with a local object
directory: fast enough for every run. Each test gets two fresh teams, so nothing another test
(or a stack sharing the database) wrote shows up in its lists."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from fastapi import FastAPI
from fastapi.testclient import TestClient

from backfill.storage import broker
from backfill.storage.process_state import reset as reset_process_state
from tests.api.own_openapi import check_response

UNREACHABLE_FLEET = "http://127.0.0.1:9/v1"  # the discard port: nothing listens, connects fail at once


@dataclass(frozen=True)
class ApiEnv:
    admin_key: str
    home: Path
    broker_prefix: str
    redis_url: str


@pytest.fixture(scope="package")
def api_env(scratch_pg_url: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiEnv]:
    env = ApiEnv(
        admin_key="sk-admin-" + secrets.token_hex(16),
        home=tmp_path_factory.mktemp("api-home"),
        broker_prefix=f"api-test-{secrets.token_hex(4)}:",
        redis_url=redis_url,
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BACKFILL_ENVIRONMENT", "development")
        mp.setenv("BACKFILL_DATABASE_URL", scratch_pg_url)
        mp.setenv("BACKFILL_BROKER_URL", redis_url)
        mp.setenv("BACKFILL_HOME", str(env.home))
        mp.setenv("BACKFILL_S3_ENDPOINT_URL", "")  # the local object directory under home
        mp.setenv("BACKFILL_FLEET_URLS", UNREACHABLE_FLEET)
        mp.setenv("BACKFILL_ADMIN_API_KEY", env.admin_key)
        mp.setenv("BACKFILL_BOOTSTRAP_API_KEY", "")
        mp.setenv("BACKFILL_COMPLETION_WINDOWS", "24h,1h")
        mp.setenv("BACKFILL_RATE_LIMIT", "off")  # its own tests: tests/api/test_ratelimit.py
        # Every Celery app the process builds while these tests run (one after each reset of the
        # process's state) keeps its queues under a key prefix of its own, so no worker sharing
        # this Redis database takes the messages these tests look for.
        make_celery = broker.make_celery

        def make_prefixed_celery() -> Celery:
            app = make_celery()
            app.conf.broker_transport_options = {"visibility_timeout": 3600, "global_keyprefix": env.broker_prefix}
            return app

        mp.setattr(broker, "make_celery", make_prefixed_celery)
        reset_process_state()
        try:
            yield env
        finally:
            reset_process_state()


class CheckedClient(TestClient):
    """Every response is held to the app's own OpenAPI document."""

    def __init__(self, app: FastAPI, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.fastapi_app = app

    def request(self, method: str, url: Any, **kwargs: Any) -> Any:
        response = super().request(method, url, **kwargs)
        check_response(self.fastapi_app.openapi(), response)
        return response


@pytest.fixture(scope="package")
def api(api_env: ApiEnv) -> Iterator[CheckedClient]:
    from backfill.api.app import create_app

    with CheckedClient(create_app(), base_url="http://backfill.test", raise_server_exceptions=False) as client:
        yield client


@dataclass(frozen=True)
class Team:
    project_id: str
    key: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


def _new_team(api: CheckedClient, admin_key: str) -> Team:
    admin = {"Authorization": f"Bearer {admin_key}"}
    project = api.post("/v1/organization/projects", headers=admin, json={"name": f"t-{secrets.token_hex(6)}"})
    assert project.status_code == 200, project.text
    key = api.post(f"/v1/organization/projects/{project.json()['id']}/api_keys", headers=admin, json={"name": "test"})
    assert key.status_code == 200, key.text
    return Team(project_id=project.json()["id"], key=key.json()["value"])


@pytest.fixture
def team(api: CheckedClient, api_env: ApiEnv) -> Team:
    return _new_team(api, api_env.admin_key)


@pytest.fixture
def other_team(api: CheckedClient, api_env: ApiEnv) -> Team:
    return _new_team(api, api_env.admin_key)


@pytest.fixture
def admin_headers(api_env: ApiEnv) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_env.admin_key}"}
