from __future__ import annotations

import json

import orjson
import pytest

from backfill.jobs.execution.replies import normalise_body, outcome_of, usage_from_body
from backfill.scheduler.fleet.client import add_routing_hints


def test_usage_from_chat_and_responses_bodies() -> None:
    chat = {
        "usage": {
            "prompt_tokens": 10,
            "completion_tokens": 5,
            "prompt_tokens_details": {"cached_tokens": 8},
            "completion_tokens_details": {"reasoning_tokens": 2},
        }
    }
    u = usage_from_body(chat)
    assert (u.prompt_tokens, u.cached_tokens, u.completion_tokens, u.reasoning_tokens) == (10, 8, 5, 2)
    resp = {
        "usage": {
            "input_tokens": 7,
            "output_tokens": 3,
            "input_tokens_details": {"cached_tokens": 1},
            "output_tokens_details": {"reasoning_tokens": 0},
        }
    }
    u = usage_from_body(resp)
    assert (u.prompt_tokens, u.cached_tokens, u.completion_tokens) == (7, 1, 3)
    assert usage_from_body({"usage": {"prompt_tokens": -1}}).prompt_tokens == 0
    assert usage_from_body("nope").prompt_tokens == 0


def test_non_json_fleet_body_is_wrapped() -> None:
    body, parsed = normalise_body(b"<html>bad gateway</html>")
    assert parsed["error"]["message"].startswith("<html>") and body.startswith(b"{")


def test_routing_hints_never_touch_client_fields() -> None:
    body = {"model": "m", "messages": [], "temperature": 0.3, "nvext": {"agent_hints": {"osl": 5}}, "n": 2}
    out = add_routing_hints(body, "nvext")
    assert out["nvext"]["agent_hints"] == {"osl": 5, "priority": -10}
    assert {k: v for k, v in out.items() if k != "nvext"} == {k: v for k, v in body.items() if k != "nvext"}
    assert body["nvext"]["agent_hints"] == {"osl": 5}  # the input is not mutated
    assert add_routing_hints(body, "none") is body


CHAT = {"id": "chatcmpl-1", "object": "chat.completion", "choices": [{"message": {"content": "a\nb"}}]}
ENVELOPE = {"error": {"message": "too long", "type": "BadRequestError", "param": None, "code": 400}}


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (json.dumps(CHAT, indent=2).encode(), 200),  # pretty-printed
        (orjson.dumps(CHAT) + b"\n", 200),  # a trailing newline
        (orjson.dumps(CHAT) + b"\r\n", 200),
        (json.dumps(ENVELOPE, indent=2).encode() + b"\n", 400),  # already the envelope, pretty
    ],
)
def test_a_body_is_stored_on_one_line_whatever_its_layout(raw: bytes, status: int) -> None:
    """A result line embeds the stored body as it is: a newline byte in it splits the line."""
    body, parsed = normalise_body(raw, status)
    assert b"\n" not in body and b"\r" not in body
    assert orjson.loads(body) == parsed == orjson.loads(raw)


def test_a_compact_body_is_kept_byte_for_byte() -> None:
    raw = orjson.dumps(CHAT) + b" "  # whitespace that splits nothing
    assert normalise_body(raw, 200)[0] is raw


def test_outcome_of_parses_once_for_body_request_id_and_usage() -> None:
    raw = json.dumps({**CHAT, "usage": {"prompt_tokens": 4, "completion_tokens": 2}}, indent=1).encode()
    outcome = outcome_of(200, raw, None)
    assert outcome.request_id == "chatcmpl-1" and b"\n" not in outcome.body
    assert (outcome.usage.prompt_tokens, outcome.usage.completion_tokens) == (4, 2)
    assert outcome_of(200, raw, "hdr-1").request_id == "hdr-1"  # the fleet's x-request-id first
    failed = outcome_of(503, b"overloaded", None)
    assert failed.status_code == 503 and orjson.loads(failed.body)["error"]["message"] == "overloaded"
