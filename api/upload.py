"""Streaming multipart parser for `POST /v1/files`.

Starlette's form parser spools the whole file before the route runs; here the file part's
bytes flow straight into the object store (in a worker thread) while they arrive, so the
size cap stops an oversize upload at the cap, not after it has been received.
"""

from __future__ import annotations

import queue
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio
from python_multipart.multipart import MultipartParser, parse_options_header

from jobs.errors import InvalidRequest

_END = object()
MAX_FIELD_BYTES = 64 * 1024


@dataclass
class ParsedForm:
    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None
    file_result: Any = None


class _FileFeed:
    """A bounded hand-off from the event loop to a blocking consumer running in a thread."""

    def __init__(self) -> None:
        self.q: queue.Queue[object] = queue.Queue(maxsize=16)

    def chunks(self) -> Iterator[bytes]:
        while (item := self.q.get()) is not _END:
            assert isinstance(item, bytes)
            yield item


async def parse_upload(
    content_type: str, body: AsyncIterator[bytes], consume_file: Callable[[Iterator[bytes]], Any]
) -> ParsedForm:
    """Parse the form; the first file part is handed to `consume_file` as a chunk iterator."""
    ctype, options = parse_options_header(content_type)
    if ctype != b"multipart/form-data" or b"boundary" not in options:
        raise InvalidRequest("Upload files as multipart/form-data.", param="file")
    form = ParsedForm()
    feed = _FileFeed()
    state: dict[str, Any] = {
        "headers": {},
        "name": None,
        "is_file": False,
        "data": bytearray(),
        "hname": b"",
        "hval": b"",
    }
    pending: list[object] = []
    file_done = anyio.Event()

    def on_part_begin() -> None:
        state.update(headers={}, name=None, is_file=False, data=bytearray())

    def on_header_field(data: bytes, start: int, end: int) -> None:
        state["hname"] += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        state["hval"] += data[start:end]

    def on_header_end() -> None:
        state["headers"][state["hname"].lower()] = state["hval"]
        state["hname"], state["hval"] = b"", b""

    def on_headers_finished() -> None:
        _, opts = parse_options_header(state["headers"].get(b"content-disposition", b""))
        state["name"] = opts.get(b"name", b"").decode("utf-8", "replace")
        if b"filename" in opts and state["name"] == "file" and form.filename is None:
            state["is_file"] = True
            form.filename = opts[b"filename"].decode("utf-8", "replace")

    def on_part_data(data: bytes, start: int, end: int) -> None:
        if state["is_file"]:
            pending.append(bytes(data[start:end]))
        else:
            state["data"] += data[start:end]
            if len(state["data"]) > MAX_FIELD_BYTES:
                raise InvalidRequest(f"Form field {state['name']!r} is too large.", param=state["name"])

    def on_part_end() -> None:
        if state["is_file"]:
            pending.append(_END)
        elif state["name"]:
            form.fields[state["name"]] = state["data"].decode("utf-8", "replace")

    parser = MultipartParser(
        options[b"boundary"],
        {
            "on_part_begin": on_part_begin,
            "on_header_field": on_header_field,
            "on_header_value": on_header_value,
            "on_header_end": on_header_end,
            "on_headers_finished": on_headers_finished,
            "on_part_data": on_part_data,
            "on_part_end": on_part_end,
        },
    )

    error: list[BaseException] = []

    async def run_consumer() -> None:
        try:
            form.file_result = await anyio.to_thread.run_sync(consume_file, feed.chunks())
        except Exception as exc:  # noqa: BLE001 - handed to the producer, which re-raises it
            error.append(exc)
            # Drain so the producer never blocks on a full queue after the consumer gave up.
            while True:
                try:
                    feed.q.get_nowait()
                except queue.Empty:
                    break
        finally:
            file_done.set()

    async def push(item: object) -> None:
        while not error:
            try:
                feed.q.put_nowait(item)
                return
            except queue.Full:
                await anyio.sleep(0.002)

    try:
        async with anyio.create_task_group() as tg:
            started = False
            try:
                async for chunk in body:
                    parser.write(chunk)
                    for item in pending:
                        if not started:
                            started = True
                            tg.start_soon(run_consumer)
                        await push(item)
                    pending.clear()
                    if error:
                        break
                parser.finalize()
            finally:
                # However the body ended, the consumer must see the end of its stream.
                if started and not file_done.is_set():
                    await push(_END)
    except BaseExceptionGroup as group:
        raise group.exceptions[0] from None
    if error:
        raise error[0]
    return form
