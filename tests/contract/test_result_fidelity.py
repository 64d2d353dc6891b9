"""Every result line holds what the official `openai` SDK accepts.

Output bodies are validated strictly (`model_validate(..., strict=True)`: a missing required
field or a wrong type fails; extra fields are allowed, as in the SDK) against the installed SDK's
model for the endpoint. Error-file bodies must be OpenAI's error envelope with the fleet's own
text kept, and every line names its request. Here: the normalisation with engines' real body
shapes, and a batch through the running stack on the Dynamo mocker; `tests/e2e/test_vllm.py`
does the same on vLLM for all four endpoints.
"""

from __future__ import annotations

import copy
from typing import Any

import orjson
import pydantic
import pytest
from openai.types import Completion, CreateEmbeddingResponse
from openai.types.chat import ChatCompletion
from openai.types.responses import Response

from backfill.jobs.execution.replies import normalise_body, request_id_of
from tests.e2e.helpers import MODEL, chat_line, jsonl, read_lines, upload, wait_for

SDK_MODELS: dict[str, type[pydantic.BaseModel]] = {
    "/v1/chat/completions": ChatCompletion,
    "/v1/completions": Completion,
    "/v1/embeddings": CreateEmbeddingResponse,
    "/v1/responses": Response,
}
ENVELOPE = {"message", "type", "param", "code"}


def assert_sdk_valid(endpoint: str, body: Any) -> pydantic.BaseModel:
    """The body as the SDK's model, validated strictly (raises pydantic.ValidationError)."""
    return SDK_MODELS[endpoint].model_validate(body, strict=True)


def assert_output_file_valid(endpoint: str, lines: list[dict[str, Any]]) -> None:
    assert lines
    for line in lines:
        assert line["error"] is None and line["response"]["status_code"] == 200, line
        assert line["response"]["request_id"], line
        try:
            assert_sdk_valid(endpoint, line["response"]["body"])
        except pydantic.ValidationError as exc:
            raise AssertionError(f"{line['custom_id']}: {endpoint} body rejected by the SDK:\n{exc}") from exc


def assert_error_line(line: dict[str, Any], fleet_text: str) -> None:
    response = line["response"]
    assert line["error"] is None and not 200 <= response["status_code"] < 300, line
    assert response["request_id"], line
    body = response["body"]
    assert set(body) == {"error"} and set(body["error"]) == ENVELOPE, body
    assert fleet_text in body["error"]["message"], body
    assert isinstance(body["error"]["type"], str) and body["error"]["type"]


# The bodies engines really answer (seen from the Dynamo frontend and vLLM 0.32 on CPU).
DYNAMO_400 = b'{"message":"`max_output_tokens` (or `max_tokens`) is required by the mocker worker","type":"Bad Request","code":400}'
VLLM_400 = (
    b'{"error":{"message":"This model\'s maximum context length is 1024 tokens.",'
    b'"type":"BadRequestError","param":null,"code":400}}'
)
FASTAPI_422 = b'{"detail":"Field required: messages"}'
PROXY_502 = b"<html><body>502 Bad Gateway</body></html>"
VLLM_RESPONSE = {
    "id": "resp_0f1e",
    "created_at": 1796168927,
    "model": "tiny-llama",
    "object": "response",
    "output": [
        {
            "id": "msg_1",
            "content": [{"annotations": [], "text": "hi", "type": "output_text", "logprobs": None}],
            "role": "assistant",
            "status": "completed",
            "type": "message",
        }
    ],
    "parallel_tool_calls": True,
    "tool_choice": "auto",
    "tools": [],
    "status": "incomplete",
    "usage": {
        "input_tokens": 12,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 4,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 16,
    },
}


@pytest.mark.parametrize(
    ("raw", "status", "fleet_text"),
    [
        (DYNAMO_400, 400, "is required by the mocker worker"),
        (VLLM_400, 400, "maximum context length is 1024 tokens"),
        (FASTAPI_422, 422, "Field required: messages"),
        (PROXY_502, 502, "502 Bad Gateway"),
        (b'{"error":"overloaded"}', 503, "overloaded"),
    ],
)
def test_fleet_error_bodies_become_openai_envelopes(raw: bytes, status: int, fleet_text: str) -> None:
    body, parsed = normalise_body(raw, status)
    assert orjson.loads(body) == parsed
    line = {"error": None, "response": {"status_code": status, "request_id": request_id_of(parsed), "body": parsed}}
    assert_error_line(line, fleet_text)
    if raw == VLLM_400:
        assert body == raw  # already the envelope: the fleet's bytes are kept as they are
    if raw == DYNAMO_400:
        assert parsed["error"]["type"] == "Bad Request" and parsed["error"]["code"] == 400


def test_a_successful_body_is_kept_byte_for_byte() -> None:
    raw = orjson.dumps({"id": "chatcmpl-1", "object": "chat.completion", "choices": []}) + b" "
    assert normalise_body(raw, 200)[0] is raw


def test_responses_usage_gets_the_field_the_sdk_requires() -> None:
    with pytest.raises(pydantic.ValidationError, match="cache_write_tokens"):
        assert_sdk_valid("/v1/responses", VLLM_RESPONSE)  # as vLLM writes it
    body, parsed = normalise_body(orjson.dumps(VLLM_RESPONSE), 200)
    response = assert_sdk_valid("/v1/responses", orjson.loads(body))
    assert isinstance(response, Response) and response.usage is not None
    assert response.usage.input_tokens_details.cache_write_tokens == 0
    # Nothing else changed.
    expected = copy.deepcopy(VLLM_RESPONSE)
    expected["usage"]["input_tokens_details"]["cache_write_tokens"] = 0
    assert parsed == expected


def test_mocker_results_validate_and_errors_are_enveloped(client: Any) -> None:
    """Chat, completions and responses on the Dynamo mocker; a refused line lands enveloped."""
    chat = [chat_line(i, max_tokens=6, temperature=0.5) for i in range(6)]
    refused = {"model": MODEL, "messages": [{"role": "user", "content": "no max_tokens"}]}  # the mocker answers 400
    chat.append({**chat_line(99), "body": refused})
    completions = [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": MODEL, "prompt": f"def f{i}(x):", "max_tokens": 5},
        }
        for i in range(6)
    ]
    # The mocker's /v1/responses bodies lack usage.input_tokens_details.cache_write_tokens.
    responses = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/responses",
            "body": {"model": MODEL, "input": f"say {i}", "max_output_tokens": 5},
        }
        for i in range(4)
    ]
    batches = {}
    for endpoint, lines in (
        ("/v1/chat/completions", chat),
        ("/v1/completions", completions),
        ("/v1/responses", responses),
    ):
        f = upload(client, jsonl(lines))
        batches[endpoint] = client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h").id
    for endpoint, batch_id in batches.items():
        done = wait_for(client, batch_id, {"completed", "failed"})
        assert done.status == "completed", done.errors
        assert_output_file_valid(endpoint, read_lines(client, done.output_file_id))
    done = client.batches.retrieve(batches["/v1/chat/completions"])
    (err,) = read_lines(client, done.error_file_id)
    assert err["custom_id"] == "req-99" and err["response"]["status_code"] == 400
    assert_error_line(err, "is required by the mocker worker")
