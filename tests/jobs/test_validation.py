from __future__ import annotations

import json

from backfill.jobs.validation.input_lines import iter_lines, iter_lines_bounded
from backfill.jobs.validation.scan import Limits, validate_lines

LIMITS = Limits(max_requests=100, max_line_bytes=10_000, max_errors=5)


def line(i: int, **body: object) -> bytes:
    b = {"model": "m", "messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 5, **body}
    return json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": b}).encode()


def test_iter_lines_offsets_survive_chunk_boundaries() -> None:
    data = b"aa\nbbbb\r\n\ncc"
    for size in range(1, len(data) + 1):
        chunks = [data[i : i + size] for i in range(0, len(data), size)]
        got = list(iter_lines(chunks))
        assert got == [(1, 0, b"aa"), (2, 3, b"bbbb\r"), (3, 9, b""), (4, 10, b"cc")]
        for _, off, raw in got:
            assert data[off : off + len(raw)] == raw
        # Lines over the limit come without their bytes, at every chunking.
        limited = list(iter_lines_bounded(chunks, max_line_bytes=3))
        assert limited == [(1, 0, 2, b"aa"), (2, 3, 5, None), (3, 9, 0, b""), (4, 10, 2, b"cc")]


def test_valid_file_builds_index() -> None:
    data = b"\n".join(line(i) for i in range(3)) + b"\n"
    result = validate_lines([data], endpoint="/v1/chat/completions", served_models={"m"}, limits=LIMITS)
    assert result.errors == [] and result.model == "m"
    assert [r["line"] for r in result.requests] == [1, 2, 3]
    for r in result.requests:
        assert json.loads(data[r["offset"] : r["offset"] + r["length"]])["custom_id"] == r["custom_id"]
    assert result.token_estimate > 15


def test_errors_are_capped_with_a_summary() -> None:
    data = b"\n".join(b"{bad" for _ in range(20))
    result = validate_lines([data], endpoint="/v1/chat/completions", served_models=None, limits=LIMITS)
    assert len(result.errors) == 6 and result.errors[-1]["code"] == "too_many_errors"
    assert "15 more" in result.errors[-1]["message"]
    assert [e["line"] for e in result.errors[:5]] == [1, 2, 3, 4, 5]


def test_shared_prefix_gets_one_fingerprint() -> None:
    long = "You are a grader. " * 100
    data = b"\n".join(
        json.dumps(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": "m", "prompt": long + f"question {i}", "max_tokens": 1},
            }
        ).encode()
        for i in range(4)
    )
    result = validate_lines([data], endpoint="/v1/completions", served_models=None, limits=LIMITS)
    assert len({r["prefix_hash"] for r in result.requests}) == 1


def test_too_many_requests_and_long_lines() -> None:
    limits = Limits(max_requests=2, max_line_bytes=200, max_errors=10)
    data = b"\n".join([line(1), line(2, stop=["x" * 300]), line(3), line(4)])
    result = validate_lines([data], endpoint="/v1/chat/completions", served_models=None, limits=limits)
    codes = [(e["line"], e["code"]) for e in result.errors]
    assert (2, "line_too_large") in codes and (3, "too_many_requests") in codes


MODERATIONS = "/v1/moderations"


def moderation(i: int, **body: object) -> bytes:
    return json.dumps({"custom_id": f"m{i}", "method": "POST", "url": MODERATIONS, "body": body}).encode()


def test_a_moderations_batch_is_accepted_with_or_without_a_model() -> None:
    """OpenAI's moderations take `input` (a string, or an array) and an optional `model`; nothing
    is generated, so a line's estimate is its input's alone."""
    text = "x" * 400
    lines = [moderation(1, input=text), moderation(2, input=["a", "b"]), moderation(3, input=text, model="m")]
    result = validate_lines([b"\n".join(lines)], endpoint=MODERATIONS, served_models={"m"}, limits=LIMITS)
    assert result.errors == [] and result.model == "m" and len(result.requests) == 3
    estimates = [row["token_estimate"] for row in result.requests]
    assert estimates == [400 // 4 + 1, len('["a","b"]') // 4 + 1, 400 // 4 + 1]

    unnamed = validate_lines([b"\n".join(lines[:2])], endpoint=MODERATIONS, served_models={"m"}, limits=LIMITS)
    assert unnamed.errors == [] and unnamed.model is None  # the fleet's default model


def test_a_moderations_line_still_meets_the_other_rules() -> None:
    lines = [moderation(1, input="a", model=""), moderation(2, input="a", model="other"), moderation(3, input="a")]
    result = validate_lines([b"\n".join(lines)], endpoint=MODERATIONS, served_models={"m"}, limits=LIMITS)
    assert [(e["line"], e["code"]) for e in result.errors] == [(1, "missing_model"), (2, "model_not_found")]
    chat = validate_lines([line(1, model=None)], endpoint="/v1/chat/completions", served_models=None, limits=LIMITS)
    assert [e["code"] for e in chat.errors] == ["missing_model"]  # optional for moderations only
