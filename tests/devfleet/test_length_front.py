"""The simulated fleet's length front: a request without a limit gets the model's default,
bounded by the context its prompt leaves; anything else passes as it came."""

from __future__ import annotations

import orjson

from backfill.devfleet.length_front import with_default_limit


def test_a_missing_limit_is_filled_per_endpoint() -> None:
    chat = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert orjson.loads(with_default_limit("/v1/chat/completions", chat, default=64, context=4096))["max_tokens"] == 64
    done = with_default_limit("/v1/completions", orjson.dumps({"prompt": "x"}), default=64, context=4096)
    assert orjson.loads(done)["max_tokens"] == 64
    done = with_default_limit("/v1/responses", orjson.dumps({"input": "x"}), default=64, context=4096)
    assert orjson.loads(done)["max_output_tokens"] == 64


def test_a_limit_given_or_a_body_not_understood_passes_untouched() -> None:
    for raw in (
        orjson.dumps({"messages": [], "max_completion_tokens": 5}),
        orjson.dumps({"messages": [], "max_tokens": 5}),
        b"not json",
        b"[1, 2]",
    ):
        assert with_default_limit("/v1/chat/completions", raw, default=64, context=4096) is raw
    raw = orjson.dumps({"input": "x"})
    assert with_default_limit("/v1/embeddings", raw, default=64, context=4096) is raw


def test_the_fill_never_overruns_the_context_the_prompt_leaves() -> None:
    raw = orjson.dumps({"prompt": "x" * 4000})
    assert orjson.loads(with_default_limit("/v1/completions", raw, default=512, context=4096))["max_tokens"] < 96
    raw = orjson.dumps({"prompt": "x" * 9000})
    assert orjson.loads(with_default_limit("/v1/completions", raw, default=512, context=4096))["max_tokens"] == 1
