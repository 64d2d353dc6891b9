"""Every batch error entry has the same four keys, built in one place with a bounded message."""

from __future__ import annotations

from backfill.jobs.errors import MESSAGE_CHARS, batch_error
from backfill.jobs.sweeps import EXPIRED_BEFORE_VALIDATION


def test_a_batch_error_has_the_four_keys_and_a_bounded_message() -> None:
    assert batch_error("c", "m") == {"code": "c", "message": "m", "param": None, "line": None}
    assert batch_error("c", "x" * 10_000, line=3, param="body.model") == {
        "code": "c",
        "message": "x" * MESSAGE_CHARS,
        "param": "body.model",
        "line": 3,
    }
    assert set(EXPIRED_BEFORE_VALIDATION) == {"code", "message", "param", "line"}
