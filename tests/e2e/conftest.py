"""The e2e suite's shared fixtures: the fault tests' measuring tools (see
tests/e2e/fault_probes.py) and the stack they break (see tests/e2e/faults.py), and the line the
suite ends with: after the pass/fail counts, the fault table and
`faults: scenarios=N lost=L duplicated=D double_billed=B stuck=S max_over_limit=K`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from backfill.devfleet.fleet import Fleet
from backfill.devfleet.processes import free_port
from backfill.devfleet.s3 import SeaweedS3
from backfill.devfleet.services import RedisServer
from backfill.devfleet.stack import BUCKET, Stack
from tests.e2e.fault_probes import FaultReport, FleetInflight, SendCounter
from tests.e2e.faults import fault_stack, make_teams

if TYPE_CHECKING:
    import openai

_REPORT = FaultReport()


@pytest.fixture(scope="session")
def fault_report() -> FaultReport:
    return _REPORT


def pytest_unconfigure(config: pytest.Config) -> None:
    # After the pass/fail counts, so the summary line is the suite's last line.
    if not _REPORT.records:
        return
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is None:
        return
    tr.write_line("")
    for row in _REPORT.table():
        tr.write_line(row)
    tr.write_line(_REPORT.summary_line())


@pytest.fixture(scope="module")
def send_counter(fleet: Fleet) -> Iterator[SendCounter]:
    counter = SendCounter(fleet.origin, free_port()).start()
    yield counter
    counter.stop()


@pytest.fixture(scope="module")
def fleet_inflight(fleet: Fleet) -> Iterator[FleetInflight]:
    with FleetInflight(fleet.frontend_metrics_url) as gauge:
        yield gauge


# -- what a fault module breaks: services of its own -----------------------------------------


@pytest.fixture(scope="module")
def faults_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    if not RedisServer.available():
        pytest.skip("redis-server is not installed")
    server = RedisServer(port=free_port(), workdir=tmp_path_factory.mktemp("faults-redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def faults_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    """An S3 server of the module's own, its data in a folder that outlives a stop (so it can be
    stopped mid-batch and started again on the same port with every object still there)."""
    with SeaweedS3(data_dir=tmp_path_factory.mktemp("faults-s3")) as server:
        server.create_bucket(BUCKET)
        yield server


@pytest.fixture(scope="module")
def fstack(
    faults_redis: RedisServer, faults_s3: SeaweedS3, send_counter: SendCounter, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """The fault module's stack: on its own Redis and S3 server, the fleet behind the counter, the
    scheduler as two replicas (a leader and a standby)."""
    with fault_stack(
        tmp_path_factory.mktemp("faults"), redis_url=faults_redis.url + "/0", s3=faults_s3, counter=send_counter
    ) as s:
        yield s


@pytest.fixture(scope="module")
def faults_db(fstack: Stack) -> str:
    return fstack.database_url


@pytest.fixture(scope="module")
def teams(fstack: Stack) -> list[openai.OpenAI]:
    return make_teams(fstack)
