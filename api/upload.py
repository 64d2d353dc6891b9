"""Streaming multipart parser for `POST /v1/files`.

Starlette's form parser spools the whole file before the route runs; here the file part's
bytes flow straight into the object store while they arrive, so the size cap stops an
oversize upload at the cap, not after it has been received.

The store's write is blocking (boto3 reads a file-like object), so it runs in a thread fed
from the event loop through a small bounded stream. Those threads come from a pool of their
own, never from the shared pool that sync routes and dependencies (the key check) run in:
a client that stalls mid-upload holds an upload thread, never a thread another route needs.
Every wait for the client's bytes has a bound, and every part of the form a cap.

Nothing is stored unless the whole form was received and checked: the filename is checked
before the write starts, each field as it completes, all fields together at the end, and
only then does the write see the end of the file. Any failure before that (client gone,
idle too long, a bad field, a body over its cap) ends the write with `UploadInterrupted`,
so the store discards what it had instead of keeping a truncated object.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import suppress
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import anyio.from_thread
import anyio.to_thread
from anyio.lowlevel import RunVar
from anyio.streams.memory import MemoryObjectReceiveStream
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from backfill.api.limits import MAX_FORM_FIELD_BYTES, MAX_FORM_FIELDS, MAX_PART_HEADER_BYTES, max_concurrent_uploads
from backfill.jobs import files as file_service
from backfill.jobs.errors import InvalidRequest
from backfill.storage.settings import get_settings

if TYPE_CHECKING:
    from python_multipart.multipart import MultipartCallbacks

DEFAULT_IDLE_TIMEOUT_S = 60.0
# Chunks in flight between the event loop and the store's thread (each up to ~64 KiB).
FEED_CHUNKS = 16

_upload_threads: RunVar[anyio.CapacityLimiter] = RunVar("backfill_upload_threads")


def upload_thread_limiter() -> anyio.CapacityLimiter:
    """The upload threads of this event loop: apart from anyio's default pool of 40."""
    try:
        return _upload_threads.get()
    except LookupError:
        limiter = anyio.CapacityLimiter(max_concurrent_uploads())
        _upload_threads.set(limiter)
        return limiter


def idle_timeout_s() -> float:
    return get_settings().upload_idle_timeout_s


@dataclass
class ParsedForm:
    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None
    file_result: Any = None
    # Set once every field passed `jobs.files.upload_options`.
    purpose: str = ""
    expires_after_s: int | None = None


def _check_file_fields(form: ParsedForm) -> None:
    checked = file_service.upload_options(form.fields)
    form.purpose, form.expires_after_s = checked.purpose, checked.expires_after_s


def _any_name(filename: str) -> str:
    return filename


def _ignore_field(name: str, value: str) -> None:
    pass


def _no_fields(form: ParsedForm) -> None:
    pass


@dataclass(frozen=True)
class FormSpec:
    """What a streamed form holds: the name of its one file part, and how the rest is checked."""

    file_field: str
    # Whether the file part must say a filename to count as the file.
    needs_filename: bool
    check_filename: Callable[[str], str]
    check_field: Callable[[str, str], None]  # each field as soon as it has arrived
    finish: Callable[[ParsedForm], None]  # all fields together, once the form ended


# `POST /v1/files`: `file`, `purpose`, `expires_after[...]`.
FILE_FORM = FormSpec("file", True, file_service.check_filename, file_service.check_upload_field, _check_file_fields)
# `POST /v1/uploads/{id}/parts`: the part's bytes in `data`, whatever it is named; nothing else counts.
PART_FORM = FormSpec("data", False, _any_name, _ignore_field, _no_fields)


class _End:
    """The file part ended and the whole form was accepted."""


_END = _End()


def _decode(raw: bytes, what: str, param: str | None) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest(f"The {what} is not valid UTF-8.", param=param, code="invalid_value") from None


class _FormState:
    """The parser's callbacks: caps on parts, header bytes and field bytes, checks as values complete."""

    def __init__(self, form: ParsedForm, spec: FormSpec) -> None:
        self.form = form
        self.spec = spec
        self.parts = 0
        self.field_bytes = 0
        self.header_bytes = 0
        self.headers: dict[bytes, bytes] = {}
        self.hname = bytearray()
        self.hval = bytearray()
        self.name = ""
        self.is_file = False
        self.data = bytearray()
        # File chunks parsed from the latest write, for the pump to hand to the store.
        self.file_chunks: list[bytes] = []
        # The closing boundary was seen: without it the body was cut short.
        self.complete = False

    def callbacks(self) -> MultipartCallbacks:
        return {
            "on_part_begin": self.on_part_begin,
            "on_header_field": self.on_header_field,
            "on_header_value": self.on_header_value,
            "on_header_end": self.on_header_end,
            "on_headers_finished": self.on_headers_finished,
            "on_part_data": self.on_part_data,
            "on_part_end": self.on_part_end,
            "on_end": self.on_end,
        }

    def on_part_begin(self) -> None:
        self.parts += 1
        if self.parts > MAX_FORM_FIELDS + 1:
            raise InvalidRequest(f"The form has more than {MAX_FORM_FIELDS} fields.", code="too_many_fields")
        self.headers, self.name, self.is_file, self.data = {}, "", False, bytearray()
        self.header_bytes = 0

    def _count_header(self, n: int) -> None:
        self.header_bytes += n
        if self.header_bytes > MAX_PART_HEADER_BYTES:
            raise InvalidRequest(
                f"The headers of a form part exceed {MAX_PART_HEADER_BYTES} bytes.", code="header_too_large"
            )

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._count_header(end - start)
        self.hname += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._count_header(end - start)
        self.hval += data[start:end]

    def on_header_end(self) -> None:
        self.headers[bytes(self.hname).lower()] = bytes(self.hval)
        self.hname, self.hval = bytearray(), bytearray()

    def on_headers_finished(self) -> None:
        _, opts = parse_options_header(self.headers.get(b"content-disposition", b""))
        self.name = _decode(opts.get(b"name", b""), "form field name", None)
        spec = self.spec
        if (
            self.name == spec.file_field
            and self.form.filename is None
            and (b"filename" in opts or not spec.needs_filename)
        ):
            # Checked before the first byte reaches the store.
            filename = _decode(opts.get(b"filename", b""), "file name", spec.file_field)
            self.form.filename = spec.check_filename(filename)
            self.is_file = True

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self.is_file:
            self.file_chunks.append(bytes(data[start:end]))
            return
        # Every non-file part counts, a second file part too: their total is capped.
        self.field_bytes += end - start
        if self.field_bytes > MAX_FORM_FIELD_BYTES:
            raise InvalidRequest(
                f"The form's fields exceed {MAX_FORM_FIELD_BYTES} bytes in all.",
                param=self.name or None,
                code="fields_too_large",
            )
        self.data += data[start:end]

    def on_part_end(self) -> None:
        if self.is_file or not self.name:
            return
        value = _decode(bytes(self.data), f"value of {self.name[:100]!r}", self.name[:100])
        self.spec.check_field(self.name, value)
        self.form.fields[self.name] = value

    def on_end(self) -> None:
        self.complete = True


async def _chunks_with_idle_bound(body: AsyncIterator[bytes], timeout_s: float) -> AsyncIterator[bytes]:
    iterator = aiter(body)
    while True:
        try:
            with anyio.fail_after(timeout_s):
                chunk = await anext(iterator)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise HTTPException(408, f"No upload bytes arrived for {timeout_s:g} seconds.") from None
        yield chunk


async def _take(stream: MemoryObjectReceiveStream[bytes | _End]) -> list[bytes | _End]:
    """Wait for one item, then take what else is already there: one hop to the loop per batch."""
    items = [await stream.receive()]
    with suppress(anyio.WouldBlock, anyio.EndOfStream):
        while len(items) < FEED_CHUNKS:
            items.append(stream.receive_nowait())
    return items


def _feed(stream: MemoryObjectReceiveStream[bytes | _End]) -> Iterator[bytes]:
    """The file's chunks, in the store's thread. Ends cleanly only on the end marker."""
    while True:
        try:
            items = anyio.from_thread.run(_take, stream)
        except anyio.EndOfStream:
            raise file_service.UploadInterrupted("The upload ended before the whole form was received.") from None
        for item in items:
            if isinstance(item, _End):
                return
            yield item


async def parse_upload(
    content_type: str,
    body: AsyncIterator[bytes],
    consume_file: Callable[[Iterator[bytes]], Any],
    *,
    idle_timeout: float | None = None,
    spec: FormSpec = FILE_FORM,
) -> ParsedForm:
    """Parse the form; the file part (`spec.file_field`) is handed to `consume_file` (run in an
    upload thread) as a chunk iterator that ends only after the whole form was received and checked."""
    ctype, options = parse_options_header(content_type)
    if ctype != b"multipart/form-data" or b"boundary" not in options:
        raise InvalidRequest("Upload files as multipart/form-data.", param=spec.file_field)
    form = ParsedForm()
    state = _FormState(form, spec)
    parser = MultipartParser(options[b"boundary"], state.callbacks())
    send, receive = anyio.create_memory_object_stream[bytes | _End](max_buffer_size=FEED_CHUNKS)
    consumer_error: list[BaseException] = []
    failure: BaseException | None = None

    async def run_consumer() -> None:
        try:
            form.file_result = await anyio.to_thread.run_sync(
                consume_file, _feed(receive), limiter=upload_thread_limiter()
            )
        except Exception as exc:  # noqa: BLE001 - re-raised by parse_upload once the pump stopped
            consumer_error.append(exc)
            tg.cancel_scope.cancel()  # the pump may be waiting on a stalled client: the answer is known
        finally:
            receive.close()  # a pump still sending stops at once

    async def pump() -> None:
        started = False
        async for chunk in _chunks_with_idle_bound(body, idle_timeout or idle_timeout_s()):
            parser.write(chunk)
            if state.file_chunks and not started:
                started = True
                tg.start_soon(run_consumer)
            for piece in state.file_chunks:
                await send.send(piece)
            state.file_chunks.clear()
        parser.finalize()
        if not state.complete:
            raise file_service.UploadInterrupted("The multipart body ended before its closing boundary.")
        if form.filename is None:
            raise InvalidRequest(f"Missing required parameter: '{spec.file_field}'.", param=spec.file_field)
        spec.finish(form)
        if not started:  # an empty file: the store still writes an (empty) object
            tg.start_soon(run_consumer)
        await send.send(_END)

    async with anyio.create_task_group() as tg:
        try:
            await pump()
        except anyio.get_cancelled_exc_class():
            raise
        except anyio.BrokenResourceError:
            pass  # the consumer failed and closed its end: its error is the answer
        except ClientDisconnect:
            failure = file_service.UploadInterrupted("The client disconnected during the upload.")
        except FormParserError as exc:
            failure = InvalidRequest(
                f"Malformed multipart body: {exc}", param=spec.file_field, code="invalid_multipart"
            )
        except BaseException as exc:  # noqa: BLE001 - re-raised after the consumer has seen the abort
            failure = exc
        finally:
            # Closing without the end marker makes the store's write fail (see `_feed`).
            send.close()
    receive.close()  # when no consumer ever started
    if failure is not None:
        raise failure
    if consumer_error:
        raise consumer_error[0]
    return form


def streamed_form(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    """`openapi_extra` for a route that reads its multipart form itself (streaming, above), so
    FastAPI cannot see the form: the OpenAPI document says it here."""
    schema = {"type": "object", "required": required, "properties": properties}
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": schema}}}}
