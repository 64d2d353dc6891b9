"""Prompt fingerprints along the token stream and the prefix-tree release order (no database)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from backfill.jobs.execution.prefixes import (
    BLOCK_TOKENS,
    FINGERPRINT_BYTES,
    TextBlocks,
    common_blocks,
    plan_prefix_order,
    tokenizer_blocks,
)
from backfill.jobs.validation.lines import prompt_text
from backfill.jobs.validation.scan import Limits, validate_lines

CHAT = "/v1/chat/completions"
LIMITS = Limits(max_requests=1000, max_line_bytes=1 << 20, max_errors=10)
ROOT = Path(__file__).resolve().parents[2]


def words(seed: int, n: int) -> str:
    return " ".join(f"w{seed}x{i}" for i in range(n))


def chat(*messages: tuple[str, str], **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": r, "content": c} for r, c in messages], "max_tokens": 8, **extra}


def jsonl(bodies: list[dict[str, Any]]) -> bytes:
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": CHAT, "body": b} for i, b in enumerate(bodies)]
    return b"".join(json.dumps(x).encode() + b"\n" for x in lines)


def text_path(body: dict[str, Any]) -> bytes:
    return TextBlocks().path(CHAT, body, prompt_text(CHAT, body))[0]


def test_text_blocks_follow_the_messages_and_their_roles() -> None:
    system = words(1, 300)
    a = text_path(chat(("system", system), ("user", "first question")))
    b = text_path(chat(("system", system), ("user", "second question " + words(2, 100))))
    as_user = text_path(chat(("user", system), ("user", "first question")))
    assert len(a) % FINGERPRINT_BYTES == 0 and len(a) // FINGERPRINT_BYTES >= 5
    # The shared system message is shared blocks; the same text under another role is not.
    assert common_blocks(a, b) == len(a) // FINGERPRINT_BYTES
    assert common_blocks(a, as_user) == 0


def test_plan_groups_prefixes_and_chains_agent_turns() -> None:
    def p(*blocks: int) -> bytes:
        return b"".join(x.to_bytes(FINGERPRINT_BYTES, "big") for x in blocks)

    # Lines 1..8, shuffled as a file might be: two eval prompts (prefix 7,7), an agent session
    # of three turns (9 -> 9,8 -> 9,8,6), two samples of one prompt, one short line.
    paths = {
        1: p(9, 8, 6),  # turn 3
        2: p(7, 7, 1),
        3: p(5),  # sample
        4: p(9),  # turn 1
        5: p(7, 7, 2),
        6: b"",
        7: p(9, 8),  # turn 2
        8: p(5),  # sample
    }
    lines = list(paths)
    plan = plan_prefix_order([paths[n] for n in lines], lines)
    by_rank = [line for _, line in sorted(zip(plan.rank, lines, strict=True))]
    after = dict(zip(lines, plan.after, strict=True))
    shared = dict(zip(lines, plan.shared_blocks, strict=True))
    pos = {line: by_rank.index(line) for line in lines}
    # Each subtree is one stretch of the order; a turn comes before the turns extending it.
    assert abs(pos[2] - pos[5]) == 1 and abs(pos[3] - pos[8]) == 1
    assert pos[4] < pos[7] < pos[1] and pos[1] - pos[4] == 2
    # Turn order is enforced; samples and siblings do not wait for each other.
    assert (after[4], after[7], after[1]) == (0, 4, 7)
    assert after[2] == after[5] == after[3] == after[8] == after[6] == 0
    # The KV a line shares: the eval prefix, the whole sample, the previous turn.
    assert (shared[2], shared[5], shared[3], shared[7], shared[1], shared[6]) == (2, 2, 1, 2, 2, 0)


def test_validation_orders_a_shuffled_batch_by_prefix() -> None:
    """Before prefix-aware order, lines were ordered by a hash of their first 1024 characters:
    two system prompts sharing a long preamble fell into one group, released in file order."""
    preamble = words(0, 400)  # far more than 1024 characters
    systems = [preamble + " task " + words(k + 10, 200) for k in range(2)]
    bodies = []
    for i in range(12):  # interleaved in the file: task 0, task 1, task 0, ...
        bodies.append(chat(("system", systems[i % 2]), ("user", f"q{i} " + words(50 + i, 60))))
    result = validate_lines([jsonl(bodies)], endpoint=CHAT, served_models=None, limits=LIMITS)
    assert result.errors == []
    rows = sorted(result.requests, key=lambda r: r["prefix_rank"])
    tasks = [(r["line"] - 1) % 2 for r in rows]
    assert tasks in ([0] * 6 + [1] * 6, [1] * 6 + [0] * 6)
    assert len({r["prefix_hash"] for r in rows}) == 2
    assert all(r["prefix_tokens"] >= 10 * BLOCK_TOKENS and r["after_line"] is None for r in rows)


def test_validation_chains_agent_trace_turns() -> None:
    system = ("system", words(3, 200))
    history: list[tuple[str, str]] = [system]
    turns = []
    for t in range(4):
        history = [*history, ("user", f"turn {t}: " + words(100 + t, 80))]
        turns.append(chat(*history))
        history = [*history, ("assistant", words(200 + t, 80))]
    other = chat(system, ("user", "unrelated " + words(9, 80)))
    bodies = [turns[2], other, turns[0], turns[3], turns[1]]
    result = validate_lines([jsonl(bodies)], endpoint=CHAT, served_models=None, limits=LIMITS)
    after = {r["line"]: r["after_line"] for r in result.requests}
    # File lines: 1 = turn 2, 2 = other, 3 = turn 0, 4 = turn 3, 5 = turn 1.
    assert after == {3: None, 5: 3, 1: 5, 4: 1, 2: None}
    # Every turn reserves the session's largest context (its last turn's), from the first turn on.
    kv = {r["line"]: r["kv_tokens"] for r in result.requests}
    last_turn = len(prompt_text(CHAT, turns[3])) // 4 + 1 + 8
    assert kv[3] == kv[5] == kv[1] == kv[4] == last_turn and kv[2] < last_turn


def test_validation_keeps_unshared_lines_in_groups_of_their_own() -> None:
    bodies = [chat(("user", words(i, 300))) for i in range(5)]
    result = validate_lines([jsonl(bodies)], endpoint=CHAT, served_models=None, limits=LIMITS)
    rows = list(result.requests)
    assert len({r["prefix_hash"] for r in rows}) == 5
    assert all(r["prefix_tokens"] == 0 and r["kv_tokens"] > 300 for r in rows)


def tiny_model() -> Path:
    path = ROOT / ".fleet" / "models" / "tiny-chat"
    if not (path / "tokenizer.json").exists():
        from backfill.devfleet.model import build_tiny_model

        return Path(build_tiny_model(ROOT / ".fleet" / "models" / "tiny-chat", name="tiny-chat"))
    return path


def test_tokenizer_blocks_fingerprint_the_rendered_chat_template() -> None:
    tokenizers = pytest.importorskip("tokenizers")
    jinja2 = pytest.importorskip("jinja2")
    model = tiny_model()
    blocks = tokenizer_blocks(model)
    system = words(4, 300)
    a = chat(("system", system), ("user", "q1"))
    b = chat(("system", system), ("user", "q2 " + words(5, 50)))
    path_a, count_a = blocks.path(CHAT, a, prompt_text(CHAT, a))
    path_b, _ = blocks.path(CHAT, b, prompt_text(CHAT, b))
    # What the frontend tokenizes: the model's chat template with the generation prompt.
    config = json.loads((model / "tokenizer_config.json").read_text())
    rendered = (
        jinja2.Environment()
        .from_string(config["chat_template"])
        .render(messages=a["messages"], add_generation_prompt=True, bos_token="<s>", eos_token="</s>")
    )
    tok = tokenizers.Tokenizer.from_file(str(model / "tokenizer.json"))
    ids = tok.encode(rendered, add_special_tokens=False).ids
    assert count_a == len(ids) and len(path_a) == len(ids) // BLOCK_TOKENS * FINGERPRINT_BYTES
    # The blocks shared are exactly the whole blocks of the tokens the two prompts share.
    ids_b = tok.encode(
        jinja2.Environment()
        .from_string(config["chat_template"])
        .render(messages=b["messages"], add_generation_prompt=True, bos_token="<s>", eos_token="</s>"),
        add_special_tokens=False,
    ).ids
    same = next(i for i, (x, y) in enumerate(zip(ids, ids_b, strict=False)) if x != y)
    assert common_blocks(path_a, path_b) == same // BLOCK_TOKENS


def test_tokenizer_blocks_fall_back_to_text_for_bodies_the_template_cannot_render() -> None:
    pytest.importorskip("tokenizers")
    blocks = tokenizer_blocks(tiny_model())
    body = {"model": "m", "messages": [{"role": "user", "content": {"odd": 1}}] * 3}
    odd = {"model": "m", "messages": "not a list"}
    assert blocks.path(CHAT, odd, "x" * 600) == TextBlocks().path(CHAT, odd, "x" * 600)
    assert isinstance(blocks.path(CHAT, body, prompt_text(CHAT, body))[0], bytes)
    tokens = list(range(200))
    path, count = blocks.path("/v1/completions", {"prompt": tokens}, "")
    assert count == 200 and len(path) == 3 * FINGERPRINT_BYTES


def test_n_completions_share_their_prompt() -> None:
    prompt = ("user", words(6, 300))
    bodies = [chat(prompt, n=16), chat(("user", words(7, 300)))]
    rows = {
        r["line"]: r for r in validate_lines([jsonl(bodies)], endpoint=CHAT, served_models=None, limits=LIMITS).requests
    }
    blocks = len(text_path(bodies[0])) // FINGERPRINT_BYTES
    assert rows[1]["prefix_tokens"] == blocks * BLOCK_TOKENS and rows[2]["prefix_tokens"] == 0
    assert rows[1]["kv_tokens"] >= rows[1]["prefix_tokens"] + 16 * 8  # n outputs


def test_past_the_shared_part_lines_keep_their_file_order() -> None:
    """Only the part of a path a line shares with another line orders it: unrelated prompts, and
    the questions under one shared preamble, are released in file order. So the index rows,
    written in file order, arrive in the order of the claim index (batch, state, rank): appended
    to it, not inserted at random (which doubled a million-line COPY)."""

    def p(*blocks: int) -> bytes:
        return b"".join(x.to_bytes(FINGERPRINT_BYTES, "big") for x in blocks)

    unrelated = [p(1000 - i, i) for i in range(50)]  # their paths sort against file order
    plan = plan_prefix_order(unrelated, list(range(1, 51)))
    assert list(plan.rank) == list(range(50))

    # An eval sweep: one preamble, then questions whose blocks sort against file order.
    sweep = [p(7, 7, 7, 1000 - i) for i in range(50)]
    plan = plan_prefix_order(sweep, list(range(1, 51)))
    assert list(plan.rank) == list(range(50))

    # Two preambles interleaved in the file: each is one stretch, file order within it.
    mixed = [p(5 if i % 2 else 9, 1000 - i) for i in range(20)]
    plan = plan_prefix_order(mixed, list(range(1, 21)))
    by_rank = [i for _, i in sorted(zip(plan.rank, range(20), strict=True))]
    odd, even = [i for i in range(20) if i % 2], [i for i in range(20) if not i % 2]
    assert by_rank in (odd + even, even + odd)
