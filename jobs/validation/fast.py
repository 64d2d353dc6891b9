"""The fast path of line checking: `check_line`'s rules for the common valid line, as one run of
plain comparisons (tests/jobs/test_validation_fast.py holds the two side by side)."""

from __future__ import annotations

from collections.abc import Callable

import orjson

from backfill.jobs.endpoints import batch_endpoint
from backfill.jobs.validation.lines import (
    CUSTOM_ID_MAX_CHARS,
    DEFAULT_MAX_OUTPUT_ESTIMATE,
    INT32_MAX,
    MAX_BODY_DEPTH,
    MODEL_MAX_CHARS,
    FastRequest,
    SeenIds,
)


def line_checker(endpoint: str, seen_ids: SeenIds) -> Callable[[bytes, int], FastRequest | None]:
    """`check_line` for the common valid line, several times cheaper: the same parse (orjson),
    so the same values, then every rule of check_line as one run of plain comparisons. It
    confirms a line valid or gives up: None for any line it cannot confirm, with nothing
    reported and nothing added to `seen_ids`; check_line, which alone writes errors, then
    decides that line. A line it confirms, check_line would have accepted with the same values
    (tests/jobs/test_validation_fast.py holds the two side by side); its custom_id is added to
    `seen_ids` as check_line adds it.

    `check(line, number)`: `number` is the line's number, for `seen_ids`."""
    loads, dumps, encode_error = orjson.loads, orjson.dumps, orjson.JSONEncodeError
    ids, id_lines = seen_ids.ids, seen_ids.lines
    add_line = id_lines.append
    kind = batch_endpoint(endpoint)
    chat = kind.prompt_key == "messages"
    no_output = not kind.produces_output
    model_optional = kind.model_optional
    prompt_key = kind.prompt_key
    int32_max, id_max, model_max, max_depth = INT32_MAX, CUSTOM_ID_MAX_CHARS, MODEL_MAX_CHARS, MAX_BODY_DEPTH
    default_output = DEFAULT_MAX_OUTPUT_ESTIMATE

    def check(line: bytes, number: int) -> FastRequest | None:
        try:
            obj = loads(line)
            # Missing keys and a line or body that is no object raise: check_line says which.
            custom_id = obj["custom_id"]
            body = obj["body"]
            # Absent where the endpoint allows it (None): the fleet's default model.
            model = body["model"] if not model_optional or "model" in body else None
            if (
                obj["method"] != "POST"
                or obj["url"] != endpoint
                or type(custom_id) is not str
                or not custom_id
                or len(custom_id) > id_max
                or "\x00" in custom_id
                or custom_id in ids
                or type(body) is not dict
                or (type(model) is not str and (model is not None or not model_optional))
                or (model is not None and (not model or len(model) > model_max or "\x00" in model))
            ):
                return None
        except (ValueError, KeyError, TypeError):  # (orjson.JSONDecodeError is a ValueError)
            return None
        get = body.get
        # COUNT_KEYS: each absent (None), or an int (bool is not one) from 1 to INT32_MAX.
        completion = get("max_completion_tokens")
        tokens = get("max_tokens")
        output_tokens = get("max_output_tokens")
        n = get("n")
        if (
            (completion is not None and (type(completion) is not int or not 0 < completion <= int32_max))
            or (tokens is not None and (type(tokens) is not int or not 0 < tokens <= int32_max))
            or (output_tokens is not None and (type(output_tokens) is not int or not 0 < output_tokens <= int32_max))
            or (n is not None and (type(n) is not int or not 0 < n <= int32_max))
            or get("stream") is True
        ):
            return None
        # Nested too deep to re-encode: check_line's test (by re-encoding, where the line has
        # more brackets than MAX_BODY_DEPTH). The body's depth is at most half the line's length
        # (a bracket to open each level, one to close it), and re-encoding is far cheaper than
        # counting the brackets of a long line.
        if len(line) > 2 * max_depth:
            try:
                dumps(body)
            except encode_error:
                return None
        if chat:  # prompt_text's rules for chat
            messages = get("messages")
            if type(messages) is list:
                parts = []
                for message in messages:
                    if type(message) is not dict:
                        continue
                    role = message.get("role")
                    content = message.get("content")
                    if type(role) is str and type(content) is str:  # the common message
                        parts.append(f"<{role}>{content}")
                        continue
                    if type(content) is list:
                        content = "".join(
                            [p["text"] for p in content if type(p) is dict and type(p.get("text")) is str]
                        )
                    parts.append(f"<{role if type(role) is str else ''}>{content if type(content) is str else ''}")
                prompt = "".join(parts)
            else:
                prompt = ""
        else:
            value = get(prompt_key)
            if type(value) is str:
                prompt = value
            elif value is None:
                prompt = ""
            else:
                try:
                    prompt = dumps(value).decode()
                except encode_error:  # (nested too deep: check_line refuses the line)
                    return None
        if no_output:
            output = 0
        else:  # max_output_tokens, of the counts checked above: the first output limit, times n
            limit = completion or tokens or output_tokens or default_output
            output = limit * n if n else limit
        estimate = (len(prompt) if prompt.isascii() else len(prompt.encode())) // 4 + 1 + output
        if estimate > int32_max:
            return None
        ids[custom_id] = None  # SeenIds.add
        add_line(number)
        return custom_id, model, prompt, estimate, body, output, n or 1

    return check
