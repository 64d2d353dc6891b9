"""Credentials are per deployment: the fleet's key goes to the fleet only, the overflow's to the
overflow only, and an overflow with no key of its own gets no Authorization header at all."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from backfill.scheduler.fleet.client import FleetClient

REPLY = {"id": "x", "object": "chat.completion", "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}


class _Recorder(ThreadingHTTPServer):
    seen: list[str | None]


class _Handler(BaseHTTPRequestHandler):
    server: _Recorder

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.seen.append(self.headers.get("Authorization"))
        body = json.dumps(REPLY).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def servers() -> Iterator[tuple[_Recorder, _Recorder]]:
    made = []
    for _ in range(2):
        server = _Recorder(("127.0.0.1", 0), _Handler)
        server.seen = []
        threading.Thread(target=server.serve_forever, daemon=True).start()
        made.append(server)
    yield made[0], made[1]
    for server in made:
        server.shutdown()
        server.server_close()


def _url(server: _Recorder) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}/v1"


def _send_to_each(client: FleetClient) -> None:
    async def run() -> None:
        for deployment in range(client.deployments):
            reply = await client.post("/v1/chat/completions", {"model": "m"}, deployment=deployment)
            assert reply.status_code == 200
        await client.aclose()

    asyncio.run(run())


def test_an_overflow_without_a_key_gets_no_authorization(servers: tuple[_Recorder, _Recorder]) -> None:
    fleet, overflow = servers
    _send_to_each(FleetClient([_url(fleet)], timeout_s=5, api_key="fleet-secret", overflow_urls=[_url(overflow)]))
    assert fleet.seen == ["Bearer fleet-secret"]
    assert overflow.seen == [None], "the fleet's key went to the overflow provider"


def test_each_deployment_gets_its_own_key(servers: tuple[_Recorder, _Recorder]) -> None:
    fleet, overflow = servers
    _send_to_each(
        FleetClient(
            [_url(fleet)],
            timeout_s=5,
            api_key="fleet-secret",
            overflow_urls=[_url(overflow)],
            overflow_api_key="overflow-secret",
        )
    )
    assert fleet.seen == ["Bearer fleet-secret"]
    assert overflow.seen == ["Bearer overflow-secret"]
