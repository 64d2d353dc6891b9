"""A large file validated by several processes gives exactly what one pass gives: the same
errors with the same line numbers (blank lines, CRLF, lines cut by a range boundary, a
custom_id repeated across ranges, a second model, too many requests), the same index rows.

The merge is checked in-process at every cut point of a small file; the processes themselves
(a fork server, each reading its range from the store) on a local directory and on SeaweedFS."""

from __future__ import annotations

import functools
import json
import pickle
from pathlib import Path
from typing import Any

import pytest

from backfill.jobs.validation.scan import Limits, ValidationResult, finish_validation, validate_lines
from backfill.scheduler.validation import pool as vp
from backfill.storage.objects import LocalObjectStore, ObjectStore, S3ObjectStore

CHAT = "/v1/chat/completions"
LIMITS = Limits(max_requests=10_000, max_line_bytes=800, max_errors=50)


def _line(i: int, **body: Any) -> bytes:
    b = {"model": "m", "messages": [{"role": "user", "content": f"question {i} " + "x" * (i % 40)}], **body}
    return json.dumps({"custom_id": f"r{i}", "method": "POST", "url": CHAT, "body": b}).encode()


def _messy(n: int) -> bytes:
    """Valid lines among every kind of line-level trouble, at irregular places."""
    out = []
    for i in range(n):
        if i % 97 == 5:
            out.append(b"")  # blank
        elif i % 89 == 7:
            out.append(b"{not json")
        elif i % 83 == 11:
            out.append(_line(i % 50))  # a custom_id used before (often in an earlier range)
        elif i % 101 == 13:
            out.append(b'{"custom_id": "big", "pad": "' + b"p" * 900 + b'"}')  # over the line limit
        elif i % 131 == 17:
            out.append(_line(i, model="other"))
        elif i % 7 == 0:
            out.append(_line(i) + b"\r")  # CRLF
        else:
            out.append(_line(i, max_tokens=i % 9 + 1))
    return b"\n".join(out)  # no newline at the end


def _same(a: ValidationResult, b: ValidationResult) -> None:
    assert a.errors == b.errors
    assert a.error_count == b.error_count and a.model == b.model
    if not b.errors:  # (a failed batch writes no index and bills nothing: only its errors count)
        assert a.token_estimate == b.token_estimate
        assert list(a.requests.rows()) == list(b.requests.rows())


def _clean(n: int) -> bytes:
    """Valid lines only: blank lines, CRLF, prompts that share prefixes (a prefix plan to agree on)."""
    shared = "Read the attached report carefully, then answer the question that follows it. " * 6
    out = []
    for i in range(n):
        if i % 37 == 3:
            out.append(b"")
        body: dict[str, Any] = {"max_tokens": i % 5 + 1}
        if i % 3 == 0:
            body["messages"] = [{"role": "user", "content": shared + f"question {i}"}]
        out.append(_line(i, **body) + (b"\r" if i % 11 == 0 else b""))
    return b"\n".join(out) + b"\n"


def _scan_at(data: bytes, cuts: list[int], store: ObjectStore, limits: Limits) -> ValidationResult:
    bounds = [0, *cuts, len(data)]
    first = vp.scan_range(lambda: store, "f", bounds[0], bounds[1], CHAT, limits)
    rest = [  # as the other processes send them
        pickle.loads(pickle.dumps(vp.packed_scan_range(lambda: store, "f", bounds[i], bounds[i + 1], CHAT, limits)))
        for i in range(1, len(bounds) - 1)
    ]
    return finish_validation(vp.merge_scans(first, rest, limits), limits=limits, served_models={"m"})


def test_every_cut_point_merges_to_the_single_pass(tmp_path: Path) -> None:
    data = _messy(400)
    store = LocalObjectStore(tmp_path)
    store.put("f", [data])
    whole = validate_lines([data], endpoint=CHAT, served_models={"m"}, limits=LIMITS)
    assert {e["code"] for e in whole.errors} >= {
        "invalid_json_line",
        "duplicate_custom_id",
        "line_too_large",
        "mismatched_model",
    }
    # Every byte position near line starts and ends, and a spread of the rest.
    starts = [i + 1 for i, c in enumerate(data) if c == 10]
    cuts = sorted({p for s in starts for p in (s - 1, s, s + 1)} | set(range(1, len(data), 97)))
    for cut in cuts:
        _same(_scan_at(data, [cut], store, LIMITS), whole)
    for a, b in [(cuts[3], cuts[-3]), (len(data) // 3, 2 * len(data) // 3), (starts[10], starts[10] + 1)]:
        _same(_scan_at(data, [a, b], store, LIMITS), whole)
    # A valid file: the same index rows (line numbers, offsets, prefix plan) at every cut.
    data = _clean(300)
    store.put("f", [data])
    whole = validate_lines([data], endpoint=CHAT, served_models={"m"}, limits=LIMITS)
    assert not whole.errors and len(whole.requests) == 300
    starts = [i + 1 for i, c in enumerate(data) if c == 10]
    for cut in sorted({p for s in starts[::7] for p in (s - 1, s, s + 1)} | set(range(1, len(data), 331))):
        _same(_scan_at(data, [cut], store, LIMITS), whole)
    _same(_scan_at(data, [starts[5], starts[100] + 3, starts[200] - 1], store, LIMITS), whole)


def test_error_cap_and_request_cap_hold_across_ranges(tmp_path: Path) -> None:
    data = _messy(400)
    store = LocalObjectStore(tmp_path)
    store.put("f", [data])
    few = Limits(max_requests=10_000, max_line_bytes=800, max_errors=3)
    whole = validate_lines([data], endpoint=CHAT, served_models={"m"}, limits=few)
    _same(_scan_at(data, [len(data) // 2], store, few), whole)
    assert whole.errors[-1]["code"] == "too_many_errors"
    # Too many requests: each range alone is within the cap, the file is not.
    clean = b"\n".join(_line(i) for i in range(100)) + b"\n"
    store.put("f", [clean])
    capped = Limits(max_requests=80, max_line_bytes=800, max_errors=5)
    merged = _scan_at(clean, [len(clean) // 2], store, capped)
    assert [e["code"] for e in merged.errors] == ["too_many_requests"]


def test_duplicate_across_ranges_names_its_later_line(tmp_path: Path) -> None:
    lines = [_line(i) for i in range(60)] + [_line(3)]
    data = b"\n".join(lines) + b"\n"
    store = LocalObjectStore(tmp_path)
    store.put("f", [data])
    merged = _scan_at(data, [len(data) // 2], store, LIMITS)
    assert [(e["code"], e["line"]) for e in merged.errors] == [("duplicate_custom_id", 61)]


def _big(n: int) -> bytes:
    return b"\n".join(_line(i, max_tokens=3) for i in range(n)) + b"\n" + _line(5) + b"\n{bad\n"


@pytest.mark.parametrize("where", ["local", "s3"])
def test_processes_read_their_ranges_and_agree_with_one_pass(
    where: str, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vp, "PARALLEL_MIN_BYTES", 64 * 1024)
    data = _big(6000)  # ~600 KB: three ranges of ~200 KB
    open_store: vp.StoreFactory
    if where == "local":
        open_store = functools.partial(LocalObjectStore, tmp_path)
    else:
        server: Any = request.getfixturevalue("s3")
        open_store = functools.partial(
            S3ObjectStore,
            endpoint_url=server.endpoint_url,
            bucket="backfill-test",
            access_key=server.access_key,
            secret_key=server.secret_key,
            region=server.region,
        )
    key = f"parallel/{where}.jsonl"
    open_store().put(key, [data])
    whole = validate_lines([data], endpoint=CHAT, served_models={"m"}, limits=LIMITS)
    assert [(e["code"], e["line"]) for e in whole.errors] == [
        ("duplicate_custom_id", 6001),
        ("invalid_json_line", 6002),
    ]
    spread = vp.validate_object(
        open_store, key, len(data), endpoint=CHAT, served_models={"m"}, limits=LIMITS, processes=3
    )
    _same(spread, whole)
    valid = data.rsplit(b"\n", 3)[0] + b"\n"  # without the repeated id and the bad line
    open_store().put(key, [valid])
    spread = vp.validate_object(
        open_store, key, len(valid), endpoint=CHAT, served_models={"m"}, limits=LIMITS, processes=3
    )
    assert spread.errors == [] and len(spread.requests) == 6000
    _same(spread, validate_lines([valid], endpoint=CHAT, served_models={"m"}, limits=LIMITS))
