"""`n > 1` on a fleet that ignores n: sent as n requests, answered as one OpenAI response."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from backfill.jobs.execution.n_choices import MAX_EXPANDED_N, merge_choices, split_n
from backfill.jobs.execution.replies import usage_from_body
from backfill.scheduler.fleet.client import FleetClient, FleetReply
from backfill.scheduler.fleet.n_expansion import post_request

CHAT = "/v1/chat/completions"


def test_split_n_gives_distinct_seeds_and_leaves_single_choices_alone() -> None:
    body = {"model": "m", "messages": [], "n": 3, "seed": 7, "max_tokens": 4}
    parts = split_n(CHAT, body)
    assert parts is not None and [p["seed"] for p in parts] == [7, 8, 9]
    assert all("n" not in p and p["max_tokens"] == 4 for p in parts)
    assert split_n(CHAT, {"n": 1}) is None and split_n("/v1/embeddings", {"n": 3}) is None
    assert split_n(CHAT, {"n": MAX_EXPANDED_N + 1}) is None
    assert len(split_n("/v1/completions", {"prompt": "x", "n": 2}) or []) == 2


def test_merge_indexes_choices_and_bills_the_prompt_once() -> None:
    """OpenAI bills an n-choice request's input once: the merged usage (what the ledger bills)
    counts the prompt of one request, the completions of all."""

    def reply(text: str, cached: int) -> bytes:
        return orjson.dumps(
            {
                "id": f"id-{text}",
                "object": "chat.completion",
                "model": "m",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}],
                "usage": {
                    "prompt_tokens": 10,
                    "completion_tokens": 4,
                    "total_tokens": 14,
                    "prompt_tokens_details": {"cached_tokens": cached},
                },
            }
        )

    merged = orjson.loads(merge_choices([reply("a", 0), reply("b", 8), reply("c", 8)]))
    assert merged["id"] == "id-a" and merged["object"] == "chat.completion"
    assert [(c["index"], c["message"]["content"]) for c in merged["choices"]] == [(0, "a"), (1, "b"), (2, "c")]
    assert merged["usage"] == {
        "prompt_tokens": 10,
        "completion_tokens": 12,
        "total_tokens": 22,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    usage = usage_from_body(merged)  # what record_usage bills
    assert (usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens) == (10, 0, 12)


@pytest.mark.slow
def test_expanded_request_on_the_mocker_comes_back_as_one_response(fleet: Any) -> None:
    body = {
        "model": "tiny-chat",
        "messages": [{"role": "user", "content": "Say something about prefix caches. " * 40}],
        "max_tokens": 5,
        "n": 3,
    }

    async def both() -> tuple[FleetReply, FleetReply]:
        client = FleetClient([fleet.base_url], timeout_s=60.0)
        try:
            plain = await post_request(client, CHAT, body, expand_n=False)
            expanded = await post_request(client, CHAT, body, expand_n=True)
            return plain, expanded
        finally:
            await client.aclose()

    plain, expanded = asyncio.run(both())
    assert plain.status_code == expanded.status_code == 200 and not expanded.transient
    assert len(orjson.loads(plain.body)["choices"]) == 1  # the mocker ignores n
    merged = orjson.loads(expanded.body)
    assert [c["index"] for c in merged["choices"]] == [0, 1, 2]
    assert merged["usage"]["completion_tokens"] == 15
    one_prompt = orjson.loads(plain.body)["usage"]["prompt_tokens"]
    assert merged["usage"]["prompt_tokens"] == one_prompt  # the input is billed once
    assert merged["usage"]["total_tokens"] == one_prompt + 15


@pytest.mark.slow
def test_a_failed_sample_fails_the_line(fleet: Any) -> None:
    body = {"model": "no-such-model", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "n": 2}

    async def send() -> FleetReply:
        client = FleetClient([fleet.base_url], timeout_s=60.0)
        try:
            return await post_request(client, CHAT, body, expand_n=True)
        finally:
            await client.aclose()

    reply = asyncio.run(send())
    assert reply.status_code == 404 and "choices" not in orjson.loads(reply.body)


def test_auto_completes_what_a_fleet_ignoring_n_left_out(fleet: Any) -> None:
    """What drains do (expand_n None): the body goes whole; the mocker answers one choice, so
    the other n-1 are asked for and merged: the client gets the n choices it asked for."""
    body = {
        "model": "tiny-chat",
        "messages": [{"role": "user", "content": "Say something about rollouts. " * 40}],
        "max_tokens": 4,
        "n": 4,
        "seed": 11,
    }
    sent: list[dict[str, Any]] = []

    async def go() -> FleetReply:
        client = FleetClient([fleet.base_url], timeout_s=60.0)
        post = client.post

        async def recording(endpoint: str, b: dict[str, Any], **kw: Any) -> FleetReply:
            sent.append(b)
            return await post(endpoint, b, **kw)

        client.post = recording  # type: ignore[method-assign]
        try:
            return await post_request(client, CHAT, body, expand_n=None)
        finally:
            await client.aclose()

    reply = asyncio.run(go())
    merged = orjson.loads(reply.body)
    assert reply.status_code == 200 and [c["index"] for c in merged["choices"]] == [0, 1, 2, 3]
    assert merged["usage"]["completion_tokens"] == 16
    # The whole body first (n=4, as a fleet honouring n would take it), then the 3 it left out,
    # each with its own seed (seed+1.. : distinct samples, still reproducible).
    assert sent[0] == body and [b.get("n") for b in sent[1:]] == [None] * 3
    assert [b["seed"] for b in sent[1:]] == [12, 13, 14]
