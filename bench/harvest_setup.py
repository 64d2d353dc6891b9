"""The harvest benchmark's set-up around each run (bench/harvest.py): a scratch database, the batch
whose lines backfill's side dispatches, and a clean Redis database for leases and limits."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PG_ADMIN_URL = os.environ.get("TEST_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("HARVEST_REDIS_URL", "redis://127.0.0.1:6379/7")
MODEL = "tiny-chat"


def setup_database() -> str:
    import psycopg

    name = f"backfill_harvest_{secrets.token_hex(4)}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = PG_ADMIN_URL.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://") + f"/{name}"
    env = {**os.environ, "BACKFILL_DATABASE_URL": url}
    subprocess.run([sys.executable, "-m", "backfill", "migrate"], env=env, check=True, cwd=ROOT, capture_output=True)
    return url


def drop_database(url: str) -> None:
    import psycopg

    name = url.rsplit("/", 1)[1]
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def prepare_batch(salt: str, n: int, model: str = MODEL) -> str:
    """A batch of n lines for `model` through the same service functions the API and validation
    task use."""
    import orjson

    from backfill.jobs import batches, files, teams
    from backfill.jobs.models import new_id
    from backfill.jobs.validation.outcome import apply_validation
    from backfill.jobs.validation.scan import Limits, validate_lines
    from backfill.storage.db import unit_of_work
    from backfill.storage.objects import get_object_store
    from bench.loadgen import batch_body

    store = get_object_store()
    data = b"".join(
        orjson.dumps(
            {
                "custom_id": f"{salt}-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": batch_body(i, salt, model),
            }
        )
        + b"\n"
        for i in range(n)
    )
    with unit_of_work() as s:
        team_id = teams.get_or_create_team(s, name="harvest").id
    file_id = new_id()
    key = files.file_key(team_id, file_id)
    store.put(key, [data])
    with unit_of_work() as s:
        files.record_upload(
            s,
            file_id=file_id,
            team_id=team_id,
            purpose="batch",
            filename="harvest.jsonl",
            size=len(data),
            expires_after_s=None,
            default_batch_expiry_s=86400,
        )
        batch_id = batches.create_batch(
            s,
            team_id=team_id,
            input_file_id=file_id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            windows={"24h": 86400},
            multipliers={},
        ).id
    result = validate_lines(
        store.open(key),
        endpoint="/v1/chat/completions",
        served_models={model},
        limits=Limits(max_requests=n, max_line_bytes=1 << 20, max_errors=10),
    )
    with unit_of_work() as s:
        status = apply_validation(s, batch_id=batch_id, result=result)
    if status != "in_progress":
        raise RuntimeError(f"harvest batch did not validate: {status} {result.errors[:3]}")
    return batch_id


def retire_batch(batch_id: str) -> None:
    from backfill.jobs import batches
    from backfill.storage.db import unit_of_work

    with unit_of_work() as s:
        batches.cancel_batch(s, team_id=None, batch_id=batch_id)


def flush_redis() -> None:
    import redis

    redis.Redis.from_url(REDIS_URL).flushdb()
