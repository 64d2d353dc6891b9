"""Hostile batch input files: values that overflow a column, huge values quoted in messages,
one huge line, crafted bodies, and what happens when validation itself breaks.

The database tests run on the session's migrated Postgres (`scratch_pg_url`): the column bounds that
matter are Postgres's, not SQLite's, which stores anything."""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from sqlalchemy import create_engine, select, text
from sqlalchemy.exc import DataError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from backfill.jobs.models import Batch, BatchRequest, BatchStatus
from backfill.jobs.validation.outcome import (
    apply_validation,
    fail_batch_validation,
    is_transient_validation_error,
    validation_failure_message,
)
from backfill.jobs.validation.scan import Limits, ValidationResult, validate_lines
from backfill.storage.db import make_engine
from backfill.storage.fleet_models import FleetUnavailable
from tests.factories import make_submitted_batch, make_team

CHAT = "/v1/chat/completions"
LIMITS = Limits(max_requests=1000, max_line_bytes=100_000, max_errors=100)


def request(i: int, *, top: dict[str, Any] | None = None, **body: Any) -> dict[str, Any]:
    b = {"model": "m", "messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 5, **body}
    return {"custom_id": f"r{i}", "method": "POST", "url": CHAT, "body": b, **(top or {})}


def jsonl(*requests: dict[str, Any] | bytes) -> bytes:
    # json, not orjson: it writes integers past 64 bits, as a hostile client would.
    return b"\n".join(r if isinstance(r, bytes) else json.dumps(r).encode() for r in requests) + b"\n"


def validate(data: bytes, limits: Limits = LIMITS, served: set[str] | None = None) -> ValidationResult:
    return validate_lines([data], endpoint=CHAT, served_models=served, limits=limits)


def line_errors(result: ValidationResult) -> list[tuple[int, str, str | None]]:
    return [(e["line"], e["code"], e["param"]) for e in result.errors if e["line"] is not None]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": 2**31 - 1}, "body.max_tokens"),  # fits a column, the estimate does not
        ({"max_tokens": 2**31}, "body.max_tokens"),
        ({"max_tokens": 2**63}, "body.max_tokens"),
        ({"max_tokens": 2**64}, "body.max_tokens"),
        ({"max_completion_tokens": 2**63 - 1}, "body.max_completion_tokens"),
        ({"max_tokens": 1000, "n": 10**7}, "body.max_tokens"),  # n times the output limit
        ({"n": 2**40}, "body.n"),
        ({"max_tokens": "5"}, "body.max_tokens"),
        ({"max_tokens": True}, "body.max_tokens"),
        ({"max_tokens": 1.5}, "body.max_tokens"),
        ({"max_tokens": 0}, "body.max_tokens"),
        ({"n": -1}, "body.n"),
    ],
)
def test_out_of_range_integers_are_line_errors(body: dict[str, Any], param: str) -> None:
    result = validate(jsonl(request(1), request(2, **body), request(3)))
    assert line_errors(result) == [(2, "invalid_value", param)]
    assert [r["line"] for r in result.requests] == [1, 3]
    assert all(r["token_estimate"] < 2**31 for r in result.requests)


def test_strings_that_overflow_a_column_are_line_errors() -> None:
    data = jsonl(
        request(1, model="m" * 257),
        request(2, top={"custom_id": "c" * 513}),
        request(3, top={"custom_id": "a\x00b"}),
        request(4, model="m\x00"),
        request(5, model="m" * 256),  # the longest a model may be: a mismatched model, no more
        request(6, top={"custom_id": "c" * 512}),
    )
    result = validate(data)
    assert line_errors(result) == [
        (1, "invalid_model", "body.model"),
        (2, "invalid_custom_id", "custom_id"),
        (3, "invalid_custom_id", "custom_id"),
        (4, "invalid_model", "body.model"),
        (6, "mismatched_model", "body.model"),
    ]


def test_messages_quote_at_most_about_100_characters() -> None:
    huge = "x" * 10_000
    data = jsonl(
        request(1, top={"url": huge}),
        request(2, top={"method": huge}),
        request(3, top={"custom_id": "d" * 500}),
        request(4, top={"custom_id": "d" * 500}),
        request(5, top={"body": huge}),
        request(6, top={"custom_id": [huge] * 50}),
        json.dumps(huge).encode(),
        request(8, model="z" * 256),
        request(9, max_tokens=[[huge]]),
        b"{" + huge.encode(),
    )
    result = validate(data)
    assert {e["line"] for e in result.errors} == set(range(1, 11)) - {3}
    # The only model, refused, next to a fleet with a long list of its own.
    refused = validate(jsonl(request(1, model="z" * 256)), served={f"{i}" + "n" * 1000 for i in range(50)})
    assert [e["code"] for e in refused.errors] == ["model_not_found"]
    for error in result.errors + refused.errors:
        assert len(error["message"]) < 300, error
        for c in "xdz":  # the user's values; the fleet's list is cut to length, no more
            assert c * 101 not in error["message"]


def test_the_errors_of_a_big_bad_file_stay_small() -> None:
    bad = (json.dumps(request(i, top={"url": "u" * 10_000})).encode() for i in range(1000))
    result = validate(b"\n".join(bad), Limits(max_requests=2000, max_line_bytes=100_000, max_errors=50))
    assert result.error_count == 1000 and len(result.errors) == 51
    assert result.errors[-1]["code"] == "too_many_errors"
    assert len(orjson.dumps(result.errors)) < 51 * 400


def test_a_huge_line_is_skipped_in_bounded_memory() -> None:
    block = b"y" * (1 << 20)
    good = json.dumps(request(2)).encode()

    def chunks() -> Iterator[bytes]:
        yield b'{"custom_id": "'
        for _ in range(48):  # a 48 MB line, without a newline in sight
            yield block
        yield b'"}\n' + good

    tracemalloc.start()
    try:
        result = validate_lines(chunks(), endpoint=CHAT, served_models=None, limits=LIMITS)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak >> 20} MiB held for a 48 MiB line"
    assert line_errors(result) == [(1, "line_too_large", None)]
    assert "50331665 bytes" in result.errors[0]["message"]
    ((index,),) = [[r for r in result.requests]]
    assert (index["line"], index["offset"], index["length"]) == (2, 15 + 48 * (1 << 20) + 3, len(good))


@pytest.mark.parametrize(
    "body",
    [
        {"messages": 5},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}, {"text": None}, 7]}]},
        {"messages": [{"role": [[[["deep"]]]] * 100, "content": "x"}]},
        {"messages": [None, 3, "x", {"role": None, "content": {"a": 1}}]},
    ],
)
def test_crafted_chat_bodies_never_raise(body: dict[str, Any]) -> None:
    result = validate(jsonl(request(1, **body)))
    assert result.errors == [] and len(result.requests) == 1


def test_bodies_too_deep_to_forward_are_line_errors() -> None:
    deep: Any = "x"
    for _ in range(300):
        deep = [deep]
    result = validate(jsonl(request(1, messages=[{"role": "user", "content": deep}]), request(2, extra=deep)))
    assert line_errors(result) == [(1, "invalid_body", "body"), (2, "invalid_body", "body")]
    # A prompt re-encoded for its estimate, on the way to the same line error.
    completion = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": "m", "prompt": deep}}
    result = validate_lines([jsonl(completion)], endpoint="/v1/completions", served_models=None, limits=LIMITS)
    assert line_errors(result) == [(1, "invalid_body", "body")]


def test_non_utf8_is_a_line_error_and_blank_lines_are_skipped() -> None:
    good = json.dumps(request(1)).encode()
    latin1 = json.dumps(request(2, messages=[{"role": "user", "content": "caf\u00e9"}]), ensure_ascii=False)
    data = b"\n".join([good, b"", b"   \t", b"\r", latin1.encode("latin-1"), b"\xff\xfe", good.replace(b"r1", b"r3")])
    result = validate(data + b"\r\n\n")
    assert [(e["line"], e["code"]) for e in result.errors] == [(5, "invalid_json_line"), (6, "invalid_json_line")]
    assert "not valid UTF-8: byte 0xe9" in result.errors[0]["message"]
    assert [r["line"] for r in result.requests] == [1, 7]


def test_the_envelope_rules() -> None:
    data = jsonl(
        request(1, top={"body": [1, 2]}),
        request(2, top={"custom_id": ""}),
        request(3, top={"custom_id": 3}),
        request(4, top={"method": "GET"}),
        request(5, top={"url": "/v1/completions"}),
        {"custom_id": "r6", "method": "POST", "url": CHAT},
        request(7, stream=True),
        b"[1, 2]",
    )
    assert line_errors(validate(data)) == [
        (1, "invalid_body", "body"),
        (2, "missing_custom_id", "custom_id"),
        (3, "missing_custom_id", "custom_id"),
        (4, "invalid_method", "method"),
        (5, "invalid_url", "url"),
        (6, "invalid_body", "body"),
        (7, "streaming_not_supported", "body.stream"),
        (8, "invalid_request", None),
    ]


# --- on Postgres ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def db(scratch_pg_url: str) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(scratch_pg_url)
    yield sessionmaker(bind=engine, expire_on_commit=False)
    engine.dispose()


def new_batch(db: sessionmaker[Session], status: str = BatchStatus.validating) -> str:
    with db.begin() as s:
        return make_submitted_batch(s, make_team(s), status=status).id


def apply(db: sessionmaker[Session], data: bytes) -> tuple[str, Batch]:
    batch_id = new_batch(db)
    result = validate(data)
    with db.begin() as s:
        status = apply_validation(s, batch_id=batch_id, result=result)
    with db() as s:
        batch = s.get(Batch, batch_id)
        assert batch is not None
        return status, batch


@pytest.mark.parametrize(
    ("lines", "bad"),
    [
        ([request(1), request(2, max_tokens=2**31 - 1), request(3)], [2]),
        ([request(1), request(2, max_tokens=2**63), request(3)], [2]),
        ([request(1), request(2, max_tokens=100, n=10**8), request(3)], [2]),
        ([request(i, model="m" * 257) for i in (1, 2)], [1, 2]),  # one model, too long for its column
        ([request(1), request(2, top={"custom_id": "nul\x00"}), request(3)], [2]),
        ([request(1), request(2, top={"custom_id": "c" * 513}), request(3)], [2]),
    ],
)
def test_overflowing_values_fail_the_batch_with_their_line(
    db: sessionmaker[Session], lines: list[dict[str, Any]], bad: list[int]
) -> None:
    status, batch = apply(db, jsonl(*lines))
    assert status == batch.status == BatchStatus.failed
    assert batch.errors is not None and [e["line"] for e in batch.errors] == bad


def test_big_estimates_add_up_without_overflow(db: sessionmaker[Session]) -> None:
    status, batch = apply(db, jsonl(*(request(i, max_tokens=2_000_000_000) for i in range(3))))
    assert status == BatchStatus.in_progress and batch.total == 3
    assert batch.token_estimate > 6_000_000_000
    with db() as s:
        rows = s.execute(select(BatchRequest).where(BatchRequest.batch_id == batch.id)).scalars().all()
        assert [(r.line, r.custom_id, len(r.prefix_hash)) for r in rows] == [
            (1, "r0", 16),
            (2, "r1", 16),
            (3, "r2", 16),
        ]


def test_fail_batch_validation_is_a_compare_and_set(db: sessionmaker[Session]) -> None:
    batch_id = new_batch(db)
    with db.begin() as s:
        assert fail_batch_validation(s, batch_id=batch_id, message="boom " * 500) == BatchStatus.failed
    with db() as s:
        first = s.get(Batch, batch_id)
        assert first is not None and first.failed_at is not None and first.errors is not None
        ((error,),) = [first.errors]
        assert error["code"] == "validation_failed" and error["line"] is None and len(error["message"]) <= 500
    with db.begin() as s:  # again: nothing changes
        assert fail_batch_validation(s, batch_id=batch_id, message="other") == BatchStatus.failed
    with db() as s:
        again = s.get(Batch, batch_id)
        assert again is not None and (again.errors, again.failed_at) == (first.errors, first.failed_at)

    running = new_batch(db, BatchStatus.in_progress)
    with db.begin() as s:
        assert fail_batch_validation(s, batch_id=running, message="x") == BatchStatus.in_progress
        assert fail_batch_validation(s, batch_id="nope", message="x") == "missing"
    with db() as s:
        untouched = s.get(Batch, running)
        assert untouched is not None and untouched.errors is None


def test_failures_are_sorted_into_transient_and_permanent(db: sessionmaker[Session]) -> None:
    unreachable = create_engine("postgresql+psycopg://postgres@127.0.0.1:1/none", connect_args={"connect_timeout": 2})
    with pytest.raises(OperationalError) as down:
        unreachable.connect()
    with pytest.raises(DataError) as overflow, db() as s:
        s.execute(text("SELECT CAST(:v AS integer)"), {"v": str(2**40)})
    import boto3
    from botocore.config import Config
    from botocore.exceptions import EndpointConnectionError, NoCredentialsError

    s3 = boto3.client(
        "s3",
        endpoint_url="http://127.0.0.1:1",
        aws_access_key_id="k",
        aws_secret_access_key="s",
        region_name="us-east-1",
        config=Config(retries={"max_attempts": 1}, connect_timeout=2),
    )
    with pytest.raises(EndpointConnectionError) as s3_down:
        s3.get_object(Bucket="b", Key="k")
    assert is_transient_validation_error(s3_down.value)
    assert not is_transient_validation_error(NoCredentialsError())
    assert is_transient_validation_error(down.value)
    assert is_transient_validation_error(FleetUnavailable("no models"))
    assert is_transient_validation_error(ConnectionResetError())
    for permanent in (overflow.value, ValueError("secret detail"), FileNotFoundError("key"), RecursionError()):
        assert not is_transient_validation_error(permanent)
    assert "secret detail" not in validation_failure_message(ValueError("secret detail"))
    assert "no longer exists" in validation_failure_message(FileNotFoundError("team/file"))
