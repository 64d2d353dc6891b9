"""Prompt prefixes: fingerprints of a prompt's blocks along its token stream, and the release
order they give a batch.

An inference engine caches KV in blocks of a fixed number of tokens and serves a prompt's
leading blocks from the cache when an earlier request computed the same blocks (vLLM's prefix
cache, Dynamo's KV router). So a prompt is described by its *path*: one short fingerprint per
full block of its token stream, in order. Two prompts share as many cacheable blocks as their
paths share leading fingerprints, and the paths of a batch form a prefix tree.

The token stream is the engine's own when backfill has the model's tokenizer and chat template
(`TokenizerBlocks`); otherwise a stable text approximation (`TextBlocks`): the role-marked text
of the messages cut into blocks of about as many characters as a block holds tokens. Both are
deterministic, so the same prefix gets the same node id (`node_id`) in every batch, and a
team's running batches share one tree without anything stored beside their lines.

From a batch's paths, `plan_prefix_order` derives per line:
- `prefix_rank`: the line's place in a depth-first walk of the tree, so the requests under one
  prefix run together and a prompt runs before the prompts that extend it;
- `after_line`: the nearest earlier line whose whole path is a proper prefix of this one's (an
  agent trace's previous turn): released only once that one has been in flight for
  PREFIX_WARM_S (or has finished), so its blocks are in the cache and the router knows where;
- `prefix_hash` and `prefix_tokens`: the deepest tree node this line shares with another line
  of the batch (its own n completions count), and how many tokens that node holds;
- `kv_tokens` (`session_kv`): the most KV the line's work holds, its prompt and outputs, or
  for an agent trace's turn the largest context of its session, which stays in the cache from
  the first turn to the last (a session counts once, however many of its turns are in flight). These size how much may be in flight together (`jobs.execution.claims`).
"""

from __future__ import annotations

import json
from array import array
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from hashlib import blake2b
from pathlib import Path
from typing import Any, Protocol

from backfill.jobs.endpoints import batch_endpoint

BLOCK_TOKENS = 64  # vLLM's default KV block on GPUs; the Dynamo mocker's too
MAX_BLOCKS = 128  # fingerprint the first 8192 tokens; deeper sharing hardly changes the order
FINGERPRINT_BYTES = 4  # per block in a path: a collision only reorders, it never loses a line
APPROX_CHARS_PER_TOKEN = 4
# A tokenizer is given at most this many characters per token it may keep (then the cut's
# last block is dropped, since a token may straddle the cut).
TOKENIZE_CHARS_PER_TOKEN = 8
NODE_ID_BYTES = 8  # prefix_hash: 16 hex characters, the column's size
# A prefix new to the fleet is sent with one request first, the others this long after: by then
# the engine has scheduled its prefill (its blocks are in the prefix cache) and the KV router
# knows which worker holds them. Sent all at once, each worker computes it, often several times.
PREFIX_WARM_S = 0.2


def _block_fingerprint(data: bytes) -> bytes:
    return blake2b(data, digest_size=FINGERPRINT_BYTES).digest()


def node_id(path: bytes, blocks: int) -> str:
    """The tree node `blocks` deep on `path`: the same prefix has the same id in every batch."""
    return blake2b(path[: blocks * FINGERPRINT_BYTES], digest_size=NODE_ID_BYTES).hexdigest()


class PromptBlocks(Protocol):
    """Turns a request into its path (one fingerprint per full block of its prompt) and the
    prompt's length in tokens (counted or estimated)."""

    def path(self, endpoint: str, body: dict[str, Any], prompt: str) -> tuple[bytes, int]: ...


class TextBlocks:
    """The stable text approximation: `prompt` (the role-marked text of the messages, as
    `jobs.validation.lines.prompt_text` renders it) cut into blocks of BLOCK_TOKENS x
    APPROX_CHARS_PER_TOKEN characters."""

    def __init__(self, block_tokens: int = BLOCK_TOKENS, chars_per_token: int = APPROX_CHARS_PER_TOKEN) -> None:
        self.chars_per_token = chars_per_token
        self.block_chars = block_tokens * chars_per_token
        # Fewer characters than this are fewer bytes than a block (at most 4 a character in UTF-8).
        self._short = (self.block_chars + 3) // 4

    def path(self, endpoint: str, body: dict[str, Any], prompt: str) -> tuple[bytes, int]:
        step = self.block_chars  # bytes, not characters: cheaper, and as stable
        if len(prompt) < self._short:  # too short for a block in any encoding: the common short line
            return b"", len(prompt) // self.chars_per_token + 1
        data = prompt[: step * MAX_BLOCKS].encode("utf-8", "surrogatepass")
        # _block_fingerprint of each full block, inline: a call a block cost as much as its hash.
        ends = range(step, len(data) + 1, step)
        path = b"".join([blake2b(data[end - step : end], digest_size=FINGERPRINT_BYTES).digest() for end in ends])
        return path, len(prompt) // self.chars_per_token + 1


class TokenizerBlocks:
    """The engine's own token stream: the model's chat template rendered as the frontend does,
    then its tokenizer. A request the template cannot render falls back to `fallback`."""

    def __init__(
        self,
        encode: Callable[[str], Sequence[int]],
        render: Callable[[dict[str, Any]], str] | None,
        *,
        block_tokens: int = BLOCK_TOKENS,
        fallback: PromptBlocks | None = None,
    ) -> None:
        self.encode = encode
        self.render = render
        self.block_tokens = block_tokens
        self.fallback = fallback or TextBlocks(block_tokens)

    def path(self, endpoint: str, body: dict[str, Any], prompt: str) -> tuple[bytes, int]:
        try:
            found = self._tokens(endpoint, body)
        except Exception:  # noqa: BLE001 -- a user's body a template chokes on is still a valid request
            found = None
        if found is None:
            return self.fallback.path(endpoint, body, prompt)
        tokens, count = found
        bt = self.block_tokens
        ids = array("I", tokens[: bt * MAX_BLOCKS])
        raw = ids.tobytes()
        step = bt * ids.itemsize
        path = b"".join(_block_fingerprint(raw[i * step : (i + 1) * step]) for i in range(len(ids) // bt))
        return path, count

    def _tokens(self, endpoint: str, body: dict[str, Any]) -> tuple[Sequence[int], int] | None:
        """The prompt's leading tokens (whole blocks of them where the text was cut) and its
        length in tokens (estimated past the cut)."""
        kind = batch_endpoint(endpoint)
        if kind.prompt_key == "messages":
            if self.render is None or not isinstance(body.get("messages"), list):
                return None
            text = self.render(body)
        else:
            value = body.get(kind.prompt_key)
            if isinstance(value, list) and value and all(type(t) is int and 0 <= t < 2**32 for t in value):
                return value, len(value)  # already tokens
            if not isinstance(value, str):
                return None
            text = value
        limit = self.block_tokens * MAX_BLOCKS * TOKENIZE_CHARS_PER_TOKEN
        tokens = list(self.encode(text[:limit]))
        if len(text) <= limit:
            return tokens, len(tokens)
        count = len(tokens) * len(text) // limit
        # The cut may have split a token: keep only the whole blocks before it.
        return tokens[: max(0, len(tokens) - 1) // self.block_tokens * self.block_tokens], count


def tokenizer_blocks(model_dir: Path | str, *, block_tokens: int = BLOCK_TOKENS) -> PromptBlocks:
    """Prompt blocks from a model directory (`tokenizer.json`, and the `chat_template` of
    `tokenizer_config.json`); the text approximation where either is missing or unusable."""
    model_dir = Path(model_dir)
    try:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    except Exception:  # noqa: BLE001 -- no tokenizer is a supported configuration, not an error
        return TextBlocks(block_tokens)
    render = _chat_renderer(model_dir / "tokenizer_config.json")

    def encode(text: str) -> list[int]:
        # The template writes the special tokens itself, as the frontend renders it.
        return list(tokenizer.encode(text, add_special_tokens=False).ids)

    return TokenizerBlocks(encode, render, block_tokens=block_tokens)


def _chat_renderer(config_path: Path) -> Callable[[dict[str, Any]], str] | None:
    try:
        config = json.loads(config_path.read_text())
        import jinja2.sandbox  # optional: without it, chat prompts use the text approximation
    except Exception:  # noqa: BLE001
        return None
    source = config.get("chat_template")
    if not isinstance(source, str):
        return None

    def token(name: str) -> str:
        value = config.get(name)
        return value.get("content", "") if isinstance(value, dict) else value if isinstance(value, str) else ""

    template = jinja2.sandbox.ImmutableSandboxedEnvironment().from_string(source)
    special = {"bos_token": token("bos_token"), "eos_token": token("eos_token")}

    def render(body: dict[str, Any]) -> str:
        return template.render(
            messages=body["messages"], tools=body.get("tools"), add_generation_prompt=True, **special
        )

    return render


@dataclass
class PrefixPlan:
    """Per line (in the order the paths were given): see the module docstring."""

    rank: array[int]
    after: array[int]  # 0: none (lines are numbered from 1)
    shared_blocks: array[int]
    session_kv: array[int]  # the most KV of the line's session (its chain of `after` lines)


def common_blocks(a: bytes, b: bytes) -> int:
    """How many leading block fingerprints two paths share."""
    n = min(len(a), len(b)) // FINGERPRINT_BYTES
    if a[: n * FINGERPRINT_BYTES] == b[: n * FINGERPRINT_BYTES]:
        return n
    lo, hi = 0, n  # a[:lo] equal, a[:hi] not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[: mid * FINGERPRINT_BYTES] == b[: mid * FINGERPRINT_BYTES]:
            lo = mid
        else:
            hi = mid
    return lo


def _release_order(
    paths: Sequence[bytes], lines: Sequence[int], shared: Sequence[int], increasing: bool
) -> Sequence[int]:
    """The lines in release order: by the part of its path a line shares with another line (its
    node), then a line whose whole path is that node before the lines extending it, then file
    order. Past its node a line shares nothing, so nothing else should order it: unrelated
    prompts, or the questions under one preamble, keep their file order. That is also the order
    the index rows are written in, so they append to the claim index (batch, state, rank)
    instead of landing at random in it, which doubled the cost of a million-row COPY.

    Byte order of the nodes keeps each subtree one stretch and a node before its extensions.
    A key per line is a small int (the node's place, doubled, plus one for a line longer than
    its node): few distinct nodes, so mostly cached ints, and a stable sort of lines already in
    file order keeps that order among equal keys.
    """
    n = len(paths)
    nodes: dict[bytes, int] = {}
    node_of = array("q", bytes(8 * n))
    for i in range(n):
        path = paths[i]
        node = path[: shared[i] * FINGERPRINT_BYTES]
        node_of[i] = 2 * nodes.setdefault(node, len(nodes)) + (len(path) > len(node))
    place = array("q", bytes(8 * len(nodes)))
    for pos, node in enumerate(sorted(nodes)):
        place[nodes[node]] = pos
    del nodes
    key = [2 * place[k >> 1] + (k & 1) for k in node_of]
    if increasing:
        return sorted(range(n), key=key.__getitem__)
    return sorted(range(n), key=lambda i: (key[i], lines[i]))


def _branching(paths: Sequence[bytes], order: Sequence[int], start: int) -> set[int]:
    """Lines whose whole path other lines extend in more than one way: a prompt that is itself a
    shared prefix (an eval question that happens to end where the few-shot preamble's blocks do,
    with every other question going on from it), not an earlier turn of one session, which only
    that session's later turns extend, one after another. Its extensions are siblings, not its
    next turns: none of them waits for it. (`order`: the lines by path, `start` the first with one.)"""
    branching: set[int] = set()
    # Ancestors of the current path: (path, index, the block its first extension went on with).
    stack: list[list[Any]] = []
    for i in order[start:]:
        path = paths[i]
        while stack and not path.startswith(stack[-1][0]):
            stack.pop()
        if stack and stack[-1][0] == path:
            continue  # the same prompt again
        if stack:
            top = stack[-1]
            step = path[len(top[0]) : len(top[0]) + FINGERPRINT_BYTES]
            if top[2] is None:
                top[2] = step
            elif top[2] != step:
                branching.add(top[1])
        stack.append([path, i, None])
    return branching


def plan_prefix_order(paths: Sequence[bytes], lines: Sequence[int], kv: Sequence[int] | None = None) -> PrefixPlan:
    """The release order of a batch's lines from their paths (and each line's KV tokens).

    Sorting the paths puts every subtree of the prefix tree in one stretch, a path before its
    extensions (depth-first), ties by line. The deepest node a line shares with any other line
    is its longest common prefix with a neighbour in that order. The release order itself
    (`rank`) is that walk with each line placed at its node, in file order there
    (`_release_order`). The nearest proper-prefix
    line comes from a stack of the current line's ancestors. A session (lines linked by
    `after`) holds its context in the cache from its first turn to its last, and grows: each
    of its lines carries the session's largest KV, so starting it reserves what it will need.
    """
    n = len(paths)
    # Memory: a million lines must plan in tens of MB, so no per-line tuples, dicts or lists of
    # ints beyond the sort itself. With the lines in increasing order (as validation gives them)
    # the sort's stability breaks ties by line, so the paths alone are the key.
    increasing = all(lines[i] < lines[i + 1] for i in range(n - 1))
    # A prompt shorter than a block (an empty path) shares nothing and sorts first: those lines
    # keep their order at the front, unsorted, and only the others are sorted and compared.
    short = [i for i in range(n) if not paths[i]]
    rest = [i for i in range(n) if paths[i]] if short else range(n)
    if not increasing:
        short.sort(key=lines.__getitem__)
    order = array("q", short)
    order.extend(sorted(rest, key=paths.__getitem__ if increasing else lambda i: (paths[i], lines[i])))
    start = len(short)  # the first place in the order with a path
    del short, rest
    rank, after, shared = array("q", bytes(8 * n)), array("q", bytes(8 * n)), array("q", bytes(8 * n))
    previous = 0
    for pos in range(start, n):
        i = order[pos]
        following = common_blocks(paths[i], paths[order[pos + 1]]) if pos + 1 < n else 0
        shared[i] = max(previous, following)
        previous = following
    for pos, i in enumerate(_release_order(paths, lines, shared, increasing)):
        rank[i] = pos
    shared_prompts = _branching(paths, order, start)
    # Ancestors of the current path, shallowest first: (path, line, that line's own `after`, its
    # index). A line goes after its nearest ancestor that is a turn of its session, not a prompt
    # that other lines branch off from too (`_branching`).
    stack: list[tuple[bytes, int, int, int]] = []
    for i in order[start:]:  # (shorter than a block: shares nothing cacheable, precedes nothing)
        path = paths[i]
        while stack and not path.startswith(stack[-1][0]):
            stack.pop()
        if stack and stack[-1][0] == path:
            after[i] = stack[-1][2]  # the same prompt again (samples): runs beside the first
            continue
        after[i] = next((line for _, line, _, k in reversed(stack) if k not in shared_prompts), 0)
        stack.append((path, lines[i], after[i], i))
    session_kv = array("q", kv if kv is not None else bytes(8 * n))
    if kv is not None and any(after):  # (no `after` at all: each line is its own session)
        index: Callable[[int], int] = (
            partial(bisect_left, lines) if increasing else {line: i for i, line in enumerate(lines)}.__getitem__
        )
        root = array("q", range(n))
        for i in order:  # an `after` line comes earlier in this order: its root is known
            if after[i]:
                root[i] = root[index(after[i])]
        largest = array("q", bytes(8 * n))  # per root
        for i in range(n):
            largest[root[i]] = max(largest[root[i]], kv[i])
        for i in range(n):
            session_kv[i] = largest[root[i]]
    return PrefixPlan(rank=rank, after=after, shared_blocks=shared, session_kv=session_kv)
