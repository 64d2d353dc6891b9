"""The fast path of validation (`line_checker`) against the full one (`check_line`): for generated
lines, valid and subtly invalid, both give the same verdict and the same values; a whole scan
with the fast path gives the same index, errors and ids as one without it; and the cheaper
`TextBlocks.path` and `RequestIndex.add` store exactly what they stored before."""

from __future__ import annotations

import json
from array import array
from collections.abc import Callable
from hashlib import blake2b
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import backfill.jobs.validation.scan as validation_scan
from backfill.jobs.endpoints import batch_endpoint
from backfill.jobs.execution.prefixes import FINGERPRINT_BYTES, MAX_BLOCKS, TextBlocks
from backfill.jobs.validation.fast import line_checker
from backfill.jobs.validation.input_lines import iter_lines_bounded
from backfill.jobs.validation.lines import (
    INT32_MAX,
    MAX_BODY_DEPTH,
    SeenIds,
    check_line,
    max_output_tokens,
)
from backfill.jobs.validation.request_index import INDEX_COLUMNS, RequestIndex
from backfill.jobs.validation.scan import Limits, LineScan, scan_lines

CHAT = "/v1/chat/completions"
ENDPOINTS = [CHAT, "/v1/embeddings", "/v1/completions", "/v1/responses", "/v1/moderations", "/v1/other"]
PROPERTY = settings(max_examples=600, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
SCANS = settings(PROPERTY, max_examples=150)

texts = st.text(max_size=12)
odd_text = st.one_of(
    texts,
    st.sampled_from(["", "\x00", "a\x00b", "é", "\U0001f600", "\ufffe", "x" * 512, "x" * 513, "m" * 256, "m" * 257]),
)
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, 1, INT32_MAX, INT32_MAX + 1, 2**63, 2**64, 10**30]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([1.0, 5.0, -0.0, 1e308]),
    odd_text,
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(texts, inner, max_size=3)),
    max_leaves=8,
)
counts = st.one_of(
    st.integers(1, 4096),
    st.sampled_from([None, 0, -1, 1, INT32_MAX, INT32_MAX + 1, 2**64, 10**30, True, False, 5.0, "5", [5]]),
)
part = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": odd_text}),
    st.fixed_dictionaries({}, optional={"text": json_values, "type": texts, "image_url": json_values}),
    json_scalars,
)
message = st.one_of(
    st.fixed_dictionaries(
        {},
        optional={
            "role": st.one_of(st.sampled_from(["system", "user", "assistant"]), json_scalars),
            "content": st.one_of(odd_text, st.lists(part, max_size=3), json_values),
            "name": texts,
        },
    ),
    json_values,
)
good_parts = st.lists(
    st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
        st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": texts})}),
    ),
    max_size=3,
)
# Body keys beyond the ones validation reads, which it lets through.
extras = st.dictionaries(
    st.sampled_from(["temperature", "metadata", "top_p", "tools", "user"]), json_values, max_size=2
)


def nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth - 1):
        value = [value] if depth % 2 else {"k": value}
    return value


@st.composite
def requests(draw: Callable[..., Any]) -> tuple[str, dict[str, Any]]:
    endpoint = draw(st.sampled_from([CHAT, CHAT, *ENDPOINTS]))

    def usually(good: st.SearchStrategy[Any], odd: st.SearchStrategy[Any]) -> Any:
        """Mostly a valid value, now and then one that may break a rule (or only looks odd)."""
        return draw(odd if draw(st.integers(0, 11)) == 11 else good)  # (hypothesis favours 0)

    body: dict[str, Any] = {"model": usually(st.sampled_from(["m", "tiny-chat"]), st.one_of(odd_text, json_scalars))}
    if endpoint == CHAT or draw(st.integers(0, 3)) == 0:
        good_messages = st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["system", "user"]), "content": st.one_of(texts, good_parts)}
            ),
            min_size=1,
            max_size=3,
        )
        body["messages"] = usually(good_messages, st.one_of(st.lists(message, max_size=3), json_values))
    for key in ("input", "prompt"):
        if draw(st.integers(0, 2)) == 0:
            body[key] = usually(
                st.one_of(texts, st.lists(texts, max_size=3)), st.one_of(st.lists(st.integers(0, 9)), json_values)
            )
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens", "n"):
        if draw(st.integers(0, 2)) == 0:
            body[key] = usually(st.integers(1, 4096), counts)
    if draw(st.integers(0, 3)) == 0:
        body["stream"] = usually(st.just(False), st.one_of(st.booleans(), json_scalars))
    body.update(draw(extras))
    if draw(st.integers(0, 6)) == 0:  # about as deep as a body may be, either side of the limit
        body["nested"] = nested(draw(st.integers(MAX_BODY_DEPTH - 3, MAX_BODY_DEPTH + 2)))
    if draw(st.integers(0, 6)) == 0:  # long: the depth test of long lines, and fingerprints
        body["messages"] = [{"role": "user", "content": "word " * draw(st.integers(60, 400))}]
    obj: dict[str, Any] = {
        "custom_id": usually(st.sampled_from(["r1", "r2", "é"]), st.one_of(odd_text, json_scalars)),
        "method": usually(st.just("POST"), st.one_of(st.just("GET"), json_scalars)),
        "url": usually(st.just(endpoint), st.one_of(st.sampled_from(ENDPOINTS), json_scalars)),
        "body": usually(st.just(body), json_values),
    }
    if draw(st.integers(0, 15)) == 15:
        del obj[draw(st.sampled_from(["custom_id", "method", "url", "body"]))]
    if draw(st.integers(0, 15)) == 15 and isinstance(obj.get("body"), dict):
        obj["body"].pop("model", None)
    obj.update(draw(st.dictionaries(st.sampled_from(["extra", "metadata"]), json_values, max_size=1)))
    return endpoint, obj


def mutate(draw: Callable[..., Any], raw: bytes) -> bytes:
    how = draw(st.integers(0, 20)) - 15  # mostly none
    if how == 0:  # a byte that is not UTF-8 (or not JSON) somewhere
        at = draw(st.integers(0, len(raw)))
        return raw[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80", b"\x00", b"\\"])) + raw[at:]
    if how == 1:
        return raw[: draw(st.integers(0, len(raw)))]  # cut short
    if how == 2:  # a key given twice: the last one counts
        key = draw(st.sampled_from([b'"custom_id"', b'"body"', b'"method"', b'"url"']))
        value = json.dumps(draw(json_values)).encode()
        return raw[:-1] + b", " + key + b": " + value + b"}"
    if how == 3:
        return draw(st.sampled_from([b" ", b"\t", b"\r", b""])) + raw + draw(st.sampled_from([b" ", b"\r", b""]))
    if how == 4:  # numbers orjson refuses or reads as floats
        return (
            raw[:-1] + b', "big": ' + draw(st.sampled_from([b"1e400", b"-1e309", b"1" * 400, b"1" * 30, b"NaN"])) + b"}"
        )
    if how == 5:  # a body key given twice
        at = raw.find(b'"body": {')
        if at >= 0:
            at += len(b'"body": {')
            key = draw(st.sampled_from([b'"model"', b'"max_tokens"', b'"n"', b'"stream"', b'"messages"']))
            return raw[:at] + key + b": " + json.dumps(draw(json_values)).encode() + b", " + raw[at:]
    return raw


@st.composite
def lines(draw: Callable[..., Any]) -> tuple[str, bytes]:
    endpoint, obj = draw(requests())
    raw = json.dumps(obj, ensure_ascii=draw(st.booleans())).encode()  # json: big ints, NaN, NUL escapes
    return endpoint, mutate(draw, raw)


def full_path(line: bytes, endpoint: str, seen: SeenIds, number: int) -> tuple[Any, list[tuple[Any, ...]]]:
    errors: list[tuple[Any, ...]] = []
    request = check_line(line, endpoint=endpoint, seen_ids=seen, fail=lambda *e: errors.append(e), number=number)
    if request is None:
        return None, errors
    return request.values(), errors


def seen_with(ids: list[str]) -> SeenIds:
    seen = SeenIds()
    for i, custom_id in enumerate(ids, 1):
        seen.add(custom_id, i)
    return seen


@PROPERTY
@given(lines(), st.lists(st.sampled_from(["r1", "r2", "", "é"]), max_size=2, unique=True), st.integers(1, 50))
def test_the_fast_path_gives_the_full_paths_verdict_and_values(
    case: tuple[str, bytes], before: list[str], number: int
) -> None:
    endpoint, line = case
    fast_seen, full_seen = seen_with(before), seen_with(before)
    fast = line_checker(endpoint, fast_seen)(line, number)
    full, errors = full_path(line, endpoint, full_seen, number)
    assert (fast is None) == (full is None), (fast, errors)
    if fast is None:
        # Nothing noted: the full path, which reports the errors, decides the line alone.
        assert list(fast_seen.ids) == before and len(fast_seen) == len(before)
        return
    assert errors == []
    assert fast == full
    assert all(type(a) is type(b) for a, b in zip(fast, full, strict=True))
    assert fast[5] == (max_output_tokens(fast[4]) if batch_endpoint(endpoint).produces_output else 0)
    assert list(fast_seen.ids) == list(full_seen.ids) and fast_seen.lines == full_seen.lines


def test_the_fast_path_takes_the_common_lines() -> None:
    """The lines it exists for, and valid lines of every kind it is meant to keep from the full
    path (content parts, re-encoded inputs, long lines, extra keys, stream false)."""
    bodies = [
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"x": 1}]}]},
        {"model": "m", "messages": [{"role": "user", "content": "w " * 600}], "stream": False, "n": 3, "seed": 1},
        {"model": "m", "messages": [None, {"content": None}, {"role": 5, "content": "x"}], "max_completion_tokens": 9},
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "deep": nested(MAX_BODY_DEPTH - 1),
            "pad": "p" * 600,
        },
    ]
    for body in bodies:
        line = json.dumps({"custom_id": "a", "method": "POST", "url": CHAT, "body": body}).encode()
        assert line_checker(CHAT, SeenIds())(line, 1) is not None, body
    for endpoint, key, value in [
        ("/v1/embeddings", "input", ["a", "b"]),
        ("/v1/embeddings", "input", [1, 2, 3]),
        ("/v1/completions", "prompt", "p"),
        ("/v1/responses", "input", [{"role": "user", "content": "x"}]),
    ]:
        line = orjson.dumps({"custom_id": "a", "method": "POST", "url": endpoint, "body": {"model": "m", key: value}})
        assert line_checker(endpoint, SeenIds())(line, 1) is not None, (endpoint, value)


@pytest.mark.parametrize(
    "change",
    [
        {"max_tokens": True},
        {"n": 0},
        {"max_output_tokens": INT32_MAX + 1},
        {"max_tokens": 5.0},
        {"stream": True},
        {"model": "m\x00"},
        {"model": "m" * 257},
        {"max_tokens": INT32_MAX, "n": 2},  # the estimate overflows
        {"deep": nested(MAX_BODY_DEPTH), "pad": "p" * 600},  # a body one level too deep
    ],
)
def test_the_fast_path_leaves_each_broken_rule_to_the_full_path(change: dict[str, Any]) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **change}
    line = json.dumps({"custom_id": "a", "method": "POST", "url": CHAT, "body": body}).encode()
    seen = SeenIds()
    assert line_checker(CHAT, seen)(line, 1) is None and len(seen) == 0
    assert full_path(line, CHAT, SeenIds(), 1)[0] is None


def without_fast_path(endpoint: str, seen_ids: SeenIds) -> Callable[[bytes, int], None]:
    return lambda line, number: None


def scan_state(scan: LineScan) -> tuple[Any, ...]:
    result = scan.result
    rows = list(result.requests.rows())
    return (
        result.errors,
        result.error_count,
        result.token_estimate,
        rows,
        list(scan.seen_ids.ids),
        scan.seen_ids.lines,
        scan.models,
        scan.requests,
        scan.lines,
        scan.stopped,
    )


@SCANS
@given(
    st.lists(st.one_of(lines(), st.just((CHAT, b"")), st.just((CHAT, b" \r"))), max_size=12),
    st.sampled_from(ENDPOINTS),
    st.integers(1, 12),
    st.sampled_from([b"\n", b"\r\n"]),
)
def test_a_scan_with_the_fast_path_is_the_scan_without_it(
    file: list[tuple[str, bytes]], endpoint: str, max_requests: int, ending: bytes
) -> None:
    # The same custom_ids and urls often, so duplicates and matches happen.
    data = b"".join(line.replace(b'"r1"', b'"r2"', 1 if i % 2 else 0) + ending for i, (_, line) in enumerate(file))
    assume(b"\n" not in b"".join(line for _, line in file))
    limits = Limits(max_requests=max_requests, max_line_bytes=4000, max_errors=8)

    def scan() -> tuple[Any, ...]:
        numbered = iter_lines_bounded([data], max_line_bytes=limits.max_line_bytes + 1)
        return scan_state(scan_lines(numbered, endpoint=endpoint, limits=limits))

    fast = scan()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(validation_scan, "line_checker", without_fast_path)
        full = scan()
    assert fast == full


def reference_path(prompt: str, block_chars: int = 256, chars_per_token: int = 4) -> tuple[bytes, int]:
    """TextBlocks.path as it was written before it was made cheaper."""
    data = prompt[: block_chars * MAX_BLOCKS].encode("utf-8", "surrogatepass")
    full = len(data) // block_chars
    path = b"".join(
        blake2b(data[i * block_chars : (i + 1) * block_chars], digest_size=FINGERPRINT_BYTES).digest()
        for i in range(full)
    )
    return path, len(prompt) // chars_per_token + 1


@PROPERTY
@given(
    st.one_of(
        st.text(max_size=700),
        st.text(alphabet="aé\U0001f600\ud800", max_size=700),
        st.integers(0, 2000).map(lambda n: "x" * n),
        st.sampled_from(["é" * 63, "é" * 64, "é" * 127, "é" * 128, "\U0001f600" * 64, "a" * 255, "a" * 256]),
    ),
    st.sampled_from([(64, 4), (16, 4), (3, 1), (1, 1)]),
)
def test_text_blocks_path_is_unchanged(prompt: str, sizes: tuple[int, int]) -> None:
    block_tokens, chars_per_token = sizes
    blocks = TextBlocks(block_tokens, chars_per_token)
    expected = reference_path(prompt, block_tokens * chars_per_token, chars_per_token)
    assert blocks.path(CHAT, {}, prompt) == expected


def test_text_blocks_path_stops_at_max_blocks() -> None:
    prompt = "y" * (256 * MAX_BLOCKS + 1000)
    path, count = TextBlocks().path(CHAT, {}, prompt)
    assert (path, count) == reference_path(prompt) and len(path) == MAX_BLOCKS * FINGERPRINT_BYTES


@given(
    st.lists(
        st.tuples(
            st.integers(1, INT32_MAX),
            st.integers(0, 2**40),
            st.integers(0, INT32_MAX),
            st.text(min_size=1, max_size=5),
            st.binary(max_size=12).map(lambda b: b[: len(b) // 4 * 4]),
            st.integers(1, INT32_MAX),
            st.integers(0, 2**62),
            st.integers(1, INT32_MAX),
        ),
        max_size=6,
    )
)
@settings(deadline=None, database=None)
def test_request_index_add_stores_what_it_stored(rows: list[tuple[Any, ...]]) -> None:
    index = RequestIndex()
    ints, offsets, paths, path_ends, ids, id_ends = (
        array("i"),
        array("q"),
        bytearray(),
        array("q"),
        bytearray(),
        array("q"),
    )
    for line, offset, length, custom_id, path, estimate, kv, samples in rows:
        index.add(line, offset, length, custom_id, path, estimate, kv, samples)
        ints.extend((line, length, estimate, min(kv, INT32_MAX), samples))
        offsets.append(offset)
        paths += path
        path_ends.append(len(paths))
        ids += custom_id.encode()
        id_ends.append(len(ids))
    assert index._ints == ints and index._offsets == offsets and index._paths == paths
    assert index._path_ends == path_ends and index._ids == ids and index._id_ends == id_ends
    assert [r["custom_id"] for r in index] == [r[3] for r in rows] and len(INDEX_COLUMNS) == 10
