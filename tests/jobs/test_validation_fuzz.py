"""Generated JSONL files mixing valid lines with every kind of bad one: validation never raises,
reports every bad line with its number (up to the cap), and what it produces always fits the
Postgres columns it is stored in."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from backfill.jobs.models import Batch, BatchRequest, BatchStatus
from backfill.jobs.validation.outcome import apply_validation
from backfill.jobs.validation.scan import Limits, validate_lines
from backfill.storage.db import make_engine
from tests.factories import make_submitted_batch, make_team

CHAT = "/v1/chat/completions"
MAX_LINE_BYTES = 4096
# No example database: nothing is written into the work tree.
FUZZ = settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ_DB = settings(FUZZ, max_examples=25)


@dataclass
class Line:
    raw: bytes
    bad: bool
    blank: bool = False
    custom_id: str | None = None  # of a valid line


def dumps(obj: Any, ascii_only: bool) -> bytes:
    # json, not orjson: it writes integers past 64 bits and NUL escapes, as a hostile client would.
    return json.dumps(obj, ensure_ascii=ascii_only).encode()


texts = st.text(max_size=40)
huge_ints = st.sampled_from([0, -1, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 10**30])
wrong = st.one_of(
    st.none(), st.booleans(), huge_ints, st.floats(allow_nan=False), texts, st.lists(st.integers(), max_size=3)
)
long_text = st.integers(min_value=513, max_value=3000).map(lambda n: "é" * n)  # too long for any column
long_model = st.integers(min_value=257, max_value=600).map(lambda n: "m" * n)


def request(custom_id: str, content: str, extra: dict[str, Any]) -> dict[str, Any]:
    body = {"model": "m", "messages": [{"role": "user", "content": content}], **extra}
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body}


good_extra = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": st.integers(1, 100_000),
        "n": st.integers(1, 8),
        "temperature": st.floats(0, 2),
        "stream": st.just(False),
        "metadata": st.dictionaries(texts, texts, max_size=2),
    },
)

# Each breaks one rule of a valid request: (path into the request, the value that breaks it).
BREAKS: list[tuple[tuple[str, ...], st.SearchStrategy[Any]]] = [
    (("custom_id",), st.one_of(wrong.filter(lambda v: not isinstance(v, str)), st.just(""), long_text)),
    (("custom_id",), texts.map(lambda t: t + "\x00")),
    (("method",), st.one_of(wrong, st.just("GET"), long_text)),
    (("url",), st.one_of(wrong, st.just("/v1/completions"), long_text)),
    (("body",), st.one_of(wrong, long_text)),
    (("body", "model"), st.one_of(wrong.filter(lambda v: not isinstance(v, str) or not v), long_model)),
    (("body", "model"), st.just("m\x00")),
    (("body", "stream"), st.just(True)),
    (("body", "max_tokens"), st.one_of(huge_ints.filter(lambda v: v < 1 or v >= 2**31 - 1), st.just("5"))),
    (("body", "max_completion_tokens"), st.one_of(huge_ints.filter(lambda v: v < 1 or v > 2**31), st.just(1.0))),
    (("body", "n"), st.one_of(huge_ints.filter(lambda v: v < 1 or v > 2**31), st.just(True))),
]
KINDS = ["valid"] * 3 + ["blank", "broken", "bytes", "non_utf8", "not_object", "wrong", "wrong", "missing"]
KINDS += ["duplicate", "too_large"]
MISSING = [("custom_id",), ("method",), ("url",), ("body",), ("body", "model")]


@st.composite
def jsonl_files(draw: Callable[..., Any]) -> tuple[bytes, list[Line]]:
    lines: list[Line] = []
    used: list[str] = []
    for number in range(1, draw(st.integers(0, 25)) + 1):
        kind = draw(st.sampled_from(KINDS))
        ascii_only = draw(st.booleans())
        custom_id = f"r{number}"
        obj = request(custom_id, draw(texts), draw(good_extra))
        if kind == "valid":
            lines.append(Line(dumps(obj, ascii_only), bad=False, custom_id=custom_id))
            used.append(custom_id)
        elif kind == "blank":
            lines.append(Line(draw(st.sampled_from([b"", b" ", b"\t \t", b"\r"])), bad=False, blank=True))
        elif kind == "broken":
            raw = dumps(obj, ascii_only)
            lines.append(Line(raw[: draw(st.integers(1, len(raw) - 1))], bad=True))
        elif kind == "bytes":
            raw = draw(st.binary(min_size=1, max_size=60).filter(lambda b: b"\n" not in b and not b.isspace()))
            # Whatever the bytes are, they are not a request: a JSON object with all its fields.
            lines.append(Line(raw, bad=True))
        elif kind == "non_utf8":
            raw = dumps(obj, ascii_only=False)
            cut = raw.index(b'"content": "') + len(b'"content": "')
            bad_byte = draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80\x80"]))
            lines.append(Line(raw[:cut] + bad_byte + raw[cut:], bad=True))
        elif kind == "not_object":
            value = draw(st.one_of(st.lists(st.integers(), max_size=3), texts, st.integers(), st.none()))
            lines.append(Line(dumps(value, ascii_only), bad=True))
        elif kind == "wrong":
            path, values = draw(st.sampled_from(BREAKS))
            target = obj if len(path) == 1 else obj["body"]
            target[path[-1]] = draw(values)
            lines.append(Line(dumps(obj, ascii_only), bad=True))
        elif kind == "missing":
            path = draw(st.sampled_from(MISSING))
            del (obj if len(path) == 1 else obj["body"])[path[-1]]
            lines.append(Line(dumps(obj, ascii_only), bad=True))
        elif kind == "duplicate" and used:
            obj["custom_id"] = draw(st.sampled_from(used))
            lines.append(Line(dumps(obj, ascii_only), bad=True))
        elif kind == "too_large":
            obj["body"]["messages"][0]["content"] = "x" * MAX_LINE_BYTES
            lines.append(Line(dumps(obj, ascii_only), bad=True))
        else:  # a duplicate with nothing before it to repeat
            lines.append(Line(b"", bad=False, blank=True))
    endings = [draw(st.sampled_from([b"\n", b"\r\n"])) for _ in lines]
    data = b"".join(line.raw + end for line, end in zip(lines, endings, strict=True))
    if lines and draw(st.booleans()):
        data = data[: -len(endings[-1])]  # no newline at the end
    return data, lines


def chunked(data: bytes, size: int) -> Iterator[bytes]:
    return (data[i : i + size] for i in range(0, len(data), size))


@FUZZ
@given(jsonl_files(), st.integers(1, 40), st.integers(1, 200))
def test_every_bad_line_is_reported_with_its_number(
    file: tuple[bytes, list[Line]], max_errors: int, chunk: int
) -> None:
    data, lines = file
    limits = Limits(max_requests=1000, max_line_bytes=MAX_LINE_BYTES, max_errors=max_errors)
    result = validate_lines(chunked(data, chunk), endpoint=CHAT, served_models={"m"}, limits=limits)

    bad = [n for n, line in enumerate(lines, 1) if line.bad]
    valid = [n for n, line in enumerate(lines, 1) if not line.bad and not line.blank]
    listed = [e for e in result.errors if e["code"] != "too_many_errors"]
    reported = [e["line"] for e in listed if e["line"] is not None]
    assert len(result.errors) <= max_errors + 1
    assert all(len(e["message"]) <= 500 for e in result.errors)
    assert result.error_count >= len(bad)
    if result.error_count <= max_errors:
        assert sorted(set(reported)) == bad
        assert not any(e["code"] == "too_many_errors" for e in result.errors)
    else:
        assert len(listed) == max_errors and result.errors[-1]["code"] == "too_many_errors"
        # In file order: every bad line before the last one listed is listed too.
        assert reported == sorted(reported) and set(reported) <= set(bad)
        assert set(reported) == {n for n in bad if n <= reported[-1]}
    assert any(e["code"] == "empty_file" for e in result.errors) == (not bad and not valid)

    assert [r["line"] for r in result.requests] == valid
    for r in result.requests:
        assert json.loads(data[r["offset"] : r["offset"] + r["length"]])["custom_id"] == lines[r["line"] - 1].custom_id
        assert 0 < r["token_estimate"] < 2**31 and len(r["prefix_hash"]) == 16


@pytest.fixture(scope="module")
def db(scratch_pg_url: str) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(scratch_pg_url)
    yield sessionmaker(bind=engine, expire_on_commit=False)
    engine.dispose()


@pytest.fixture(scope="module")
def team_id(db: sessionmaker[Session]) -> str:
    with db.begin() as s:
        return make_team(s).id


@FUZZ_DB
@given(file=jsonl_files(), served=st.sampled_from([None, {"m"}, {"other"}]))
def test_apply_validation_never_raises_on_postgres(
    db: sessionmaker[Session], team_id: str, file: tuple[bytes, list[Line]], served: set[str] | None
) -> None:
    data, _ = file
    with db.begin() as s:
        batch_id = make_submitted_batch(s, team_id).id
    limits = Limits(max_requests=1000, max_line_bytes=MAX_LINE_BYTES, max_errors=10)
    result = validate_lines([data], endpoint=CHAT, served_models=served, limits=limits)
    with db.begin() as s:
        status = apply_validation(s, batch_id=batch_id, result=result)
    with db() as s:
        stored = s.get(Batch, batch_id)
        assert stored is not None and stored.status == status
        rows = s.execute(select(func.count()).where(BatchRequest.batch_id == batch_id)).scalar_one()
        if result.errors:
            assert status == BatchStatus.failed and stored.errors == result.errors and rows == 0
        else:
            assert status == BatchStatus.in_progress and rows == stored.total == len(result.requests)
