"""SeaweedFS (the object store) stopped while the batches of a running load finalize, and
started again. What it checks afterwards: tests/e2e/faults.py.
"""

from __future__ import annotations

import time

import openai
import pytest

from backfill.devfleet.s3 import SeaweedS3
from backfill.devfleet.stack import Stack
from tests.e2e.fault_probes import FaultReport, FleetInflight, SendCounter
from tests.e2e.faults import (
    TERMINAL,
    Load,
    Window,
    settle,
    sql,
    submit,
)
from tests.e2e.helpers import wait_until

pytestmark = pytest.mark.e2e


def _pending(db_url: str, load: Load) -> int | None:
    rows = sql(
        db_url, "SELECT count(*) FROM batch_requests WHERE batch_id = ANY(%s) AND state = 'pending'", load.db_ids
    )
    return None if rows is None else int(rows[0][0])


def _running(db_url: str, load: Load) -> int | None:
    rows = sql(
        db_url, "SELECT count(*) FROM batch_requests WHERE batch_id = ANY(%s) AND state = 'running'", load.db_ids
    )
    return None if rows is None else int(rows[0][0])


def _statuses(db_url: str, load: Load) -> dict[str, str]:
    return dict(sql(db_url, "SELECT id, status FROM batches WHERE id = ANY(%s)", load.db_ids) or [])


def result_objects(s3: SeaweedS3, load: Load) -> dict[str, list[str]]:
    """Every object under each batch's result folder (whatever its name), by batch id."""
    client = s3.client()
    out: dict[str, list[str]] = {}
    for batch_id in load.db_ids:
        keys: list[str] = []
        for page in client.get_paginator("list_objects_v2").paginate(Bucket="backfill-test", Prefix="batches/"):
            keys += [o["Key"] for o in page.get("Contents", []) if f"/{batch_id}/" in o["Key"]]
        out[batch_id] = sorted(keys)
    return out


def test_s3_stopped_during_finalization(
    fstack: Stack,
    teams: list[openai.OpenAI],
    send_counter: SendCounter,
    fleet_inflight: FleetInflight,
    fault_report: FaultReport,
    faults_db: str,
    faults_s3: SeaweedS3,
) -> None:
    """The object store goes away once every line is claimed, so the batches finish their lines
    and reach finalization while no file can be written; it comes back after a while."""
    window = Window(send_counter, fleet_inflight, fstack)
    load = submit(teams, "s3-outage", slow_each=2)

    def all_claimed() -> bool:
        started = _statuses(faults_db, load)
        return all(st not in ("validating", "created") for st in started.values()) and _pending(faults_db, load) == 0

    wait_until("every line claimed", all_claimed, timeout_s=120, every_s=0.05)
    faults_s3.stop()
    stopped = time.monotonic()
    # A finalization whose files were already written when the store stopped may still end in
    # the next moments (its compare-and-set to the terminal status): the batches open 2 s in.
    time.sleep(2.0)
    open_at_stop = [b for b, st in _statuses(faults_db, load).items() if st not in TERMINAL]
    try:
        # Lines already claimed finish without the store; a line sent back for a retry cannot be
        # read again until the store is back (its body lives in the input file), so it waits.
        wait_until("no line running", lambda: _running(faults_db, load) == 0, timeout_s=60)
        time.sleep(max(0.0, 20.0 - (time.monotonic() - stopped)))
        during = _statuses(faults_db, load)
        left = _pending(faults_db, load)
    finally:
        faults_s3.start()
    cleared = time.monotonic()
    waiting = [b for b in open_at_stop if during[b] not in TERMINAL]
    assert open_at_stop and waiting == open_at_stop, (open_at_stop, during)  # nothing finished without its files
    finalizing = [b for b in open_at_stop if during[b] == "finalizing"]
    assert finalizing, during  # at least one batch got as far as its files
    settle(
        "S3 stopped during finalization",
        f"{len(finalizing)} of {len(open_at_stop)} batch(es) reached finalization while the store was down (20 s) "
        f"and waited in `finalizing` ({left} line(s) sent back for a retry waited for their input file); "
        "the next nudge after it was back wrote their files (one PUT each)",
        load,
        db_url=faults_db,
        cleared_at=cleared,
        window=window,
        report=fault_report,
        finished_at_clear=None,
    )
    # Exactly the result files, once each: no partial or stray objects.
    for batch_id, keys in result_objects(faults_s3, load).items():
        names = [k.rsplit("/", 1)[1] for k in keys]
        assert names in (["output.jsonl"], ["error.jsonl", "output.jsonl"]), (batch_id, keys)
    uploads = faults_s3.client().list_multipart_uploads(Bucket="backfill-test").get("Uploads", [])
    assert uploads == [], uploads
