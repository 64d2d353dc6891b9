from __future__ import annotations

from backfill.jobs.replies import normalise_body, usage_from_body
from backfill.scheduler.routing_hints import add_routing_hints


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
