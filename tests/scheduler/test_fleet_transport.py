"""The fleet client's HTTP exchange against raw servers that misbehave on purpose: what each
failure becomes (its status, whether it is worth retrying, whether it reached the fleet), and
that a call given up closes its connection, which is how the fleet learns to drop the request."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from backfill.scheduler.fleet import client as fleet_client
from backfill.scheduler.fleet.client import FleetClient, FleetReply

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OK_BODY = b'{"id":"chatcmpl-1","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}'


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """The request's head and body (Content-Length bodies only, as the fleet client sends)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return head, await reader.readexactly(length)


def response(body: bytes, *, status: str = "200 OK", extra: bytes = b"") -> bytes:
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n".encode()
        + extra
        + b"\r\n"
        + body
    )


@contextlib.asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[str]:
    """A loopback server running `handler` per connection; yields its base URL."""

    async def guarded(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(guarded, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.close()


async def post_once(url: str, **kw: float | str) -> FleetReply:
    client = FleetClient([url], **kw)  # type: ignore[arg-type]
    try:
        return await client.post("/v1/chat/completions", {"model": "m"}, deployment=0)
    finally:
        await client.aclose()


def test_a_reply_keeps_its_status_body_and_request_id_and_the_key_is_sent() -> None:
    seen: list[bytes] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, body = await read_request(reader)
        seen.append(head + body)
        writer.write(response(OK_BODY, extra=b"x-request-id: fleet-42\r\n"))
        await writer.drain()

    async def main() -> FleetReply:
        async with serving(answer) as url:
            return await post_once(url, timeout_s=5, api_key="k-1")

    reply = asyncio.run(main())
    assert (reply.status_code, reply.body, reply.request_id, reply.transient, reply.sent) == (
        200,
        OK_BODY,
        "fleet-42",
        False,
        True,
    )
    head = seen[0].lower()
    assert head.startswith(b"post /v1/chat/completions http/1.1")
    assert b"authorization: bearer k-1" in head and seen[0].endswith(b'{"model":"m"}')


def test_a_refused_connection_reached_nothing() -> None:
    async def main() -> FleetReply:
        async with serving(lambda r, w: asyncio.sleep(0)) as url:
            pass  # closed again: its port refuses connections now
        return await post_once(url, timeout_s=5)

    reply = asyncio.run(main())
    assert reply.status_code == 503 and reply.transient and not reply.sent


def test_a_reply_never_begun_times_out_as_sent() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(30)

    async def main() -> FleetReply:
        async with serving(silent) as url:
            return await post_once(url, timeout_s=0.5)

    reply = asyncio.run(main())
    assert reply.status_code == 504 and reply.transient and reply.sent
    assert b"fleet timeout" in reply.body


def test_a_body_that_stops_flowing_ends_as_stalled() -> None:
    async def stalls(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        whole = response(OK_BODY)
        writer.write(whole[:-10])  # the headers and most of the body, then nothing
        await writer.drain()
        await asyncio.sleep(30)

    async def main() -> FleetReply:
        async with serving(stalls) as url:
            return await post_once(url, timeout_s=30, body_idle_timeout_s=0.3)

    reply = asyncio.run(main())
    assert reply.status_code == 504 and reply.transient and b"stalled" in reply.body


def test_a_reply_larger_than_allowed_is_refused_for_good(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fleet_client, "MAX_REPLY_BYTES", 1000)

    async def large(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        body = b'{"pad":"' + b"x" * 5000 + b'"}'
        writer.write(response(body[:100]).replace(b"Content-Length: 100", f"Content-Length: {len(body)}".encode()))
        for k in range(100, len(body), 500):  # in pieces, as a long reply arrives
            writer.write(body[k : k + 500])
            await writer.drain()
            await asyncio.sleep(0.01)

    async def main() -> FleetReply:
        async with serving(large) as url:
            return await post_once(url, timeout_s=5)

    reply = asyncio.run(main())
    assert reply.status_code == 502 and not reply.transient and b"larger than 1000" in reply.body


def test_a_connection_dropped_mid_reply_is_worth_retrying() -> None:
    async def drops(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(response(OK_BODY)[:-20])
        await writer.drain()
        writer.transport.abort()

    async def main() -> FleetReply:
        async with serving(drops) as url:
            return await post_once(url, timeout_s=5)

    reply = asyncio.run(main())
    assert reply.status_code == 503 and reply.transient and reply.sent


def test_a_call_given_up_closes_its_connection() -> None:
    """Shedding cancels the call: the fleet sees its connection close and frees the request."""
    closed = asyncio.Event

    async def main() -> bool:
        gone = closed()

        async def waits(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_request(reader)
            if await reader.read(1) == b"":  # EOF: the client closed the connection
                gone.set()

        async with serving(waits) as url:
            client = FleetClient([url], timeout_s=30)
            call = asyncio.create_task(client.post("/v1/chat/completions", {"model": "m"}, deployment=0))
            await asyncio.sleep(0.3)
            call.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await call
            try:
                await asyncio.wait_for(gone.wait(), timeout=5)
                return True
            except TimeoutError:
                return False
            finally:
                await client.aclose()

    assert asyncio.run(main())


def test_the_environments_proxy_is_used_unless_no_proxy_covers_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> tuple[list[bytes], FleetReply, FleetReply]:
        via_proxy: list[bytes] = []

        async def proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head, _ = await read_request(reader)
            via_proxy.append(head.split(b"\r\n", 1)[0])
            writer.write(response(OK_BODY))
            await writer.drain()

        async def fleet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_request(reader)
            writer.write(response(OK_BODY, extra=b"x-request-id: direct\r\n"))
            await writer.drain()

        async with serving(proxy) as proxy_url, serving(fleet) as fleet_url:
            monkeypatch.setenv("HTTP_PROXY", proxy_url.removesuffix("/v1"))
            monkeypatch.setenv("NO_PROXY", "")
            fleet_client._env_proxy.cache_clear()
            proxied = await post_once(fleet_url, timeout_s=5)
            monkeypatch.setenv("NO_PROXY", "127.0.0.1")
            fleet_client._env_proxy.cache_clear()
            direct = await post_once(fleet_url, timeout_s=5)
        fleet_client._env_proxy.cache_clear()
        return via_proxy, proxied, direct

    via_proxy, proxied, direct = asyncio.run(main())
    assert proxied.status_code == 200 and proxied.request_id != "direct"
    assert len(via_proxy) == 1 and via_proxy[0].startswith(b"POST http://127.0.0.1:")  # absolute form
    assert direct.status_code == 200 and direct.request_id == "direct"
