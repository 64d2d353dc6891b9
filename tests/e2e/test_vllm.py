"""backfill against a real engine: vLLM on CPU serving a tiny local Llama (random weights).

Two vLLM servers (one per model: generate for chat/completions/responses, pooling for
embeddings), both started with `--scheduling-policy priority`, and backfill's real stack with
`BACKFILL_FLEET_PRIORITY_HINT=vllm` in front of them, no Dynamo in between. A small proxy
between backfill and the servers routes /v1/embeddings to the pooling server, lists both
servers' models, and records what backfill sent and what each engine answered, so the tests
can say what reached the engine, not only what came back.

Each batch goes through the official `openai` SDK; every output body is validated strictly
against the SDK's model for its endpoint (see tests/contract/test_result_fidelity.py).
vLLM is installed by `python -m backfill.devfleet install`; when it is missing the fixtures install it,
and a failed install fails these tests (it never skips them).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest

from backfill.devfleet.processes import free_port
from backfill.devfleet.s3 import SeaweedS3
from backfill.devfleet.services import private_redis
from backfill.devfleet.stack import Stack, launch_stack
from backfill.devfleet.vllm import VllmServer
from backfill.devfleet.vllm_install import MODEL_NAME, build_vllm_model, ensure_vllm_venv
from tests.contract.test_result_fidelity import (
    assert_error_line,
    assert_output_file_valid,
)
from tests.e2e.helpers import jsonl, read_lines, upload, wait_for

EMBED_MODEL = f"{MODEL_NAME}-embed"
PRIORITY = ["--scheduling-policy", "priority"]
# Eager mode starts in about half the time (no graph compilation) and these batches are small.
COMMON = ["--enforce-eager", *PRIORITY]
GENERATE_ARGS = [
    *COMMON,
    # A queue forms with a handful of requests in flight, so priority order can be seen.
    "--max-num-seqs",
    "4",
    # Each request's queue time in its body (`metrics.queue_time_ms`).
    "--enable-per-request-metrics",
    # tool_choice other than "none" needs a parser; "required" itself is structured decoding.
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "pythonic",
    # Random weights would pad JSON with whitespace until max_tokens; the schema is unchanged.
    "--structured-outputs-config",
    '{"backend": "xgrammar", "disable_any_whitespace": true}',
]
# Random weights rarely pick EOS: a small max_tokens bounds every answer.
MAX_TOKENS = 8


@dataclass
class Exchange:
    path: str
    sent: dict[str, Any]
    status: int
    answered: Any
    at: float = field(default_factory=time.time)  # when the engine's answer came back


@dataclass
class EngineRouter:
    """Between backfill and the two servers: routes by path, merges /v1/models, records POSTs."""

    generate: str  # origins
    pooling: str
    port: int
    exchanges: list[Exchange] = field(default_factory=list)
    sending: list[tuple[float, bytes]] = field(default_factory=list)  # (time.time(), body) as forwarded
    _server: Any = None
    _thread: threading.Thread | None = None
    _client: httpx.AsyncClient | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def sent_for(self, path: str, custom: str) -> list[dict[str, Any]]:
        """Bodies sent to `path` whose text holds the marker `custom` (a test's unique tag)."""
        return [e.sent for e in self.exchanges if e.path == path and custom in json.dumps(e.sent)]

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        if self._client is None:
            # A connection a request: a kept-alive one the engine's server closed meanwhile
            # would fail a request the router cannot safely send twice. The connect may wait long:
            # with the engines' threads busy on two cores (load ~30) the API server accepts late,
            # and a request the router failed comes back later, re-sent, which the priority test
            # would read as never having waited in the engine.
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(300, connect=120), limits=httpx.Limits(max_keepalive_connections=0)
            )
        path = scope["path"]
        if scope["method"] == "GET" and path == "/v1/models":
            replies = await asyncio.gather(*(self._client.get(o + path) for o in (self.generate, self.pooling)))
            models = {"object": "list", "data": [m for r in replies for m in r.json()["data"]]}
            status, content, headers = 200, json.dumps(models).encode(), {"content-type": "application/json"}
        else:
            origin = self.pooling if path == "/v1/embeddings" else self.generate
            if scope["method"] == "POST":
                self.sending.append((time.time(), body))
            query = ("?" + scope["query_string"].decode()) if scope["query_string"] else ""
            fwd = {k.decode(): v.decode() for k, v in scope["headers"] if k.lower() not in (b"host", b"content-length")}
            resp = await self._client.request(scope["method"], origin + path + query, content=body, headers=fwd)
            status, content = resp.status_code, resp.content
            headers = {k: v for k, v in resp.headers.items() if k in ("content-type", "x-request-id")}
            if scope["method"] == "POST":
                try:
                    answered: Any = json.loads(content)
                except ValueError:
                    answered = content.decode("utf-8", "replace")
                self.exchanges.append(Exchange(path, json.loads(body), status, answered))
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
            }
        )
        await send({"type": "http.response.body", "body": content})

    def start(self) -> EngineRouter:
        import uvicorn

        self._server = uvicorn.Server(
            uvicorn.Config(self, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        )
        self._thread = threading.Thread(target=self._server.run, name="engine-router", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            assert time.monotonic() < deadline, "the engine router did not start"
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmServer, VllmServer]]:
    """Both servers, started side by side (each takes 45-135 s on two cores)."""
    logs = tmp_path_factory.mktemp("vllm-logs")
    generate = VllmServer(extra_args=GENERATE_ARGS, log_dir=logs)
    pooling = VllmServer(served_model_name=EMBED_MODEL, runner="pooling", extra_args=COMMON, log_dir=logs)
    # The venv and the model are built once, then both servers boot side by side. Launched
    # from this thread: a server's leader dies with the thread that launched it.
    build_vllm_model(python=ensure_vllm_venv())
    for server in (generate, pooling):
        server.launch()
    try:
        for server in (generate, pooling):
            server.wait_ready()  # one that does not start fails the tests with its log's tail
        print(f"\nvLLM ready: generate {generate.startup_s:.0f}s, pooling {pooling.startup_s:.0f}s")
        yield generate, pooling
    finally:
        generate.stop()
        pooling.stop()


@pytest.fixture(scope="module")
def router(engines: tuple[VllmServer, VllmServer]) -> Iterator[EngineRouter]:
    generate, pooling = engines
    r = EngineRouter(generate=generate.origin, pooling=pooling.origin, port=free_port()).start()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def own_redis(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[str]:
    """A Redis of its own (broker, leases, breakers of this module's stack only); without the
    redis-server binary, another database on the shared server."""
    with private_redis(tmp_path_factory.mktemp("redis-vllm"), shared_url=redis_url.rsplit("/", 1)[0] + "/5") as url:
        yield url


@pytest.fixture(scope="module")
def vllm_stack(
    router: EngineRouter, own_redis: str, s3: SeaweedS3, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """backfill's API, worker and scheduler on a database and Redis of their own."""
    settings = {
        "BACKFILL_FLEET_PRIORITY_HINT": "vllm",
        # vLLM's Prometheus names are not the Dynamo frontend's: a fixed bound here.
        "BACKFILL_CAPACITY_CONTROL": "false",
        "BACKFILL_MAX_INFLIGHT": "16",
        "BACKFILL_TICK_INTERVAL_S": "0.5",
    }
    with launch_stack(
        tmp_path_factory.mktemp("vllm-stack"),
        settings=settings,
        s3=s3,
        fleet_url=router.base_url,
        name="vllm",
        redis_url=own_redis,
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(vllm_stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=vllm_stack.base_url, api_key=vllm_stack.key, max_retries=0, timeout=60)


def run_batch(client: openai.OpenAI, endpoint: str, bodies: list[dict[str, Any]], tag: str) -> Any:
    lines = [
        {"custom_id": f"{tag}-{i}", "method": "POST", "url": endpoint, "body": body} for i, body in enumerate(bodies)
    ]
    f = upload(client, jsonl(lines))
    b = client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h")  # type: ignore[arg-type]
    done = wait_for(client, b.id, {"completed", "failed", "expired", "cancelled"}, timeout_s=240)
    assert done.status == "completed", (done.status, done.errors)
    return done


def chat(tag: str, i: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": f"[{tag}] what is {i} + {i}?"}],
        "max_tokens": MAX_TOKENS,
        **extra,
    }


def test_models_lists_both_servers(client: openai.OpenAI) -> None:
    assert {m.id for m in client.models.list().data} == {MODEL_NAME, EMBED_MODEL}


def test_chat_completions(client: openai.OpenAI, router: EngineRouter) -> None:
    done = run_batch(client, "/v1/chat/completions", [chat("chat", i, temperature=0.7) for i in range(8)], "chat")
    out = read_lines(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in out) == sorted(f"chat-{i}" for i in range(8))
    assert_output_file_valid("/v1/chat/completions", out)
    for o in out:
        body = o["response"]["body"]
        assert body["model"] == MODEL_NAME and body["usage"]["completion_tokens"] <= MAX_TOKENS
        assert isinstance(body["choices"][0]["message"]["content"], str)
    assert done.usage.input_tokens == sum(o["response"]["body"]["usage"]["prompt_tokens"] for o in out)
    # Each result body is what the engine answered, as it answered it.
    answered = {e.answered["id"]: e.answered for e in router.exchanges if "[chat]" in json.dumps(e.sent)}
    assert len(answered) == 8
    assert all(o["response"]["body"] == answered[o["response"]["body"]["id"]] for o in out)


def test_completions(client: openai.OpenAI) -> None:
    bodies = [{"model": MODEL_NAME, "prompt": f"def f{i}(x):", "max_tokens": MAX_TOKENS} for i in range(6)]
    done = run_batch(client, "/v1/completions", bodies, "cmpl")
    out = read_lines(client, done.output_file_id)
    assert len(out) == 6
    assert_output_file_valid("/v1/completions", out)
    assert all(o["response"]["body"]["object"] == "text_completion" for o in out)


def test_embeddings(client: openai.OpenAI) -> None:
    bodies = [{"model": EMBED_MODEL, "input": f"[embed] sentence number {i}"} for i in range(6)]
    bodies.append({"model": EMBED_MODEL, "input": ["[embed] two", "[embed] inputs"]})
    done = run_batch(client, "/v1/embeddings", bodies, "emb")
    out = read_lines(client, done.output_file_id)
    assert len(out) == 7
    assert_output_file_valid("/v1/embeddings", out)
    by_id = {o["custom_id"]: o["response"]["body"] for o in out}
    assert len(by_id["emb-6"]["data"]) == 2
    dims = {len(d["embedding"]) for body in by_id.values() for d in body["data"]}
    assert dims == {128}  # the model's hidden size
    vectors = [tuple(d["embedding"]) for body in by_id.values() for d in body["data"]]
    assert len(set(vectors)) == len(vectors)  # the engine really embedded each input


def test_responses(client: openai.OpenAI, router: EngineRouter) -> None:
    bodies = [{"model": MODEL_NAME, "input": f"[resp] say {i}", "max_output_tokens": MAX_TOKENS} for i in range(4)]
    bodies.append(
        {
            "model": MODEL_NAME,
            "input": [{"role": "user", "content": "[resp] a message list"}],
            "instructions": "be brief",
            "max_output_tokens": MAX_TOKENS,
        }
    )
    done = run_batch(client, "/v1/responses", bodies, "resp")
    out = read_lines(client, done.output_file_id)
    assert len(out) == 5
    assert_output_file_valid("/v1/responses", out)
    for o in out:
        assert o["response"]["body"]["object"] == "response" and o["response"]["body"]["output"]
    # What the engine answered: backfill's output differs from it only where the SDK requires a
    # field the engine left out (vLLM 0.32 leaves none out here; the Dynamo mocker does).
    answered = {e.answered["id"]: e.answered for e in router.exchanges if "[resp]" in json.dumps(e.sent)}
    assert len(answered) == 5
    for o in out:
        body, raw = o["response"]["body"], answered[o["response"]["body"]["id"]]
        raw["usage"]["input_tokens_details"].setdefault("cache_write_tokens", 0)
        assert body == raw
    assert done.usage.output_tokens == sum(o["response"]["body"]["usage"]["output_tokens"] for o in out)


ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no", "maybe"]}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def test_structured_output_and_tools_reach_the_engine_untouched(client: openai.OpenAI, router: EngineRouter) -> None:
    import jsonschema

    schema_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True}}
    bodies = [chat("schema", i, response_format=schema_format, max_tokens=32) for i in range(3)]
    # parallel_tool_calls=False: exactly one call (random weights would otherwise keep adding calls).
    bodies += [
        chat("tools", i, tools=[WEATHER_TOOL], tool_choice="required", parallel_tool_calls=False, max_tokens=48)
        for i in range(3)
    ]
    done = run_batch(client, "/v1/chat/completions", bodies, "fmt")
    out = {o["custom_id"]: o["response"]["body"] for o in read_lines(client, done.output_file_id)}
    assert len(out) == 6, done.request_counts
    assert_output_file_valid("/v1/chat/completions", read_lines(client, done.output_file_id))
    for i in range(3):
        # Structured decoding: random weights, yet the content obeys the schema.
        message = out[f"fmt-{i}"]["choices"][0]["message"]
        jsonschema.validate(json.loads(message["content"]), ANSWER_SCHEMA)
        # tool_choice="required": the engine must call a tool, with arguments per its schema.
        message = out[f"fmt-{3 + i}"]["choices"][0]["message"]
        assert len(message["tool_calls"]) == 1, message
        for call in message["tool_calls"]:
            assert call["type"] == "function" and call["function"]["name"] == "get_weather"
            jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER_TOOL["function"]["parameters"])
    # Exactly the client's bodies reached the engine, plus only the priority backfill adds.
    for tag, expected in (("[schema]", bodies[:3]), ("[tools]", bodies[3:])):
        sent = sorted(router.sent_for("/v1/chat/completions", tag), key=json.dumps)
        assert sent == sorted(({**b, "priority": 10} for b in expected), key=json.dumps)


def test_n_choices_in_one_body(client: openai.OpenAI, router: EngineRouter) -> None:
    done = run_batch(client, "/v1/chat/completions", [chat("n", i, n=3, temperature=1.0) for i in range(3)], "n")
    out = read_lines(client, done.output_file_id)
    assert_output_file_valid("/v1/chat/completions", out)
    for o in out:
        body = o["response"]["body"]
        assert sorted(c["index"] for c in body["choices"]) == [0, 1, 2]
        assert body["usage"]["completion_tokens"] <= 3 * MAX_TOKENS
    # vLLM does n itself: one request per line, n intact.
    sent = router.sent_for("/v1/chat/completions", "[n]")
    assert len(sent) == 3 and all(b["n"] == 3 for b in sent)


def waiting_in(engine: VllmServer) -> float:
    """The engine's own count of requests waiting to be scheduled."""
    text = httpx.get(engine.metrics_url, timeout=5).text
    return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith("vllm:num_requests_waiting{"))


PRIO_LINES = 120
HOLD_TOKENS = 900
LIVE, LIVE_TOKENS = 4, 600  # as many interactive requests as the engine has slots, each long
HOLDERS = 12  # the engine's four slots, and eight more waiting to take a slot the moment one frees


class EngineHold:
    """Long requests of the test's own straight to the engine at a priority above everything
    else (-1), sent again as each ends, so the engine's four slots stay taken however fast it
    runs: what reaches the engine meanwhile waits in its queue. `release` drops them (vLLM
    aborts a request whose client went away); the engine then schedules what waits, in its
    policy's order. Twelve at a time keep the API server that takes them responsive."""

    def __init__(self, engine: VllmServer) -> None:
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="engine-hold", daemon=True)
        self.tasks: list[asyncio.Future[Any]] = []
        self.client: httpx.AsyncClient | None = None

    async def _keep(self, client: httpx.AsyncClient, i: int) -> None:
        body = chat("hold", i, max_tokens=HOLD_TOKENS, ignore_eos=True, priority=-1)
        while True:
            try:
                r = await client.post(f"{self.engine.base_url}/chat/completions", json=body, timeout=300)
            except httpx.TransportError:
                continue  # a kept-alive connection the server had closed: send it again
            assert r.status_code == 200, r.text

    async def _start(self) -> None:
        self.client = httpx.AsyncClient(limits=httpx.Limits(max_connections=HOLDERS, max_keepalive_connections=0))
        self.tasks = [asyncio.ensure_future(self._keep(self.client, i)) for i in range(HOLDERS)]

    async def _stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.client is not None:
            await self.client.aclose()

    def __enter__(self) -> EngineHold:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=10)
        return self

    def failed(self) -> BaseException | None:
        """What ended a holder early (a refused request), if anything did."""
        return next((t.exception() for t in self.tasks if t.done() and not t.cancelled()), None)

    def release(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(timeout=30)

    def __exit__(self, *exc: object) -> None:
        if any(not t.done() for t in self.tasks):
            self.release()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def test_priority_mode_reaches_the_engine(client: openai.OpenAI, router: EngineRouter, engines: Any) -> None:
    """BACKFILL_FLEET_PRIORITY_HINT=vllm: each body carries vLLM's `priority` (larger = later)
    and no Dynamo `nvext`, a client's own priority kept. vLLM 0.32 accepts a priority even
    on its default (fcfs) policy, so acceptance alone shows nothing: the check is the order.

    Made independent of the machine's speed by holding the engine (`EngineHold`): while its
    slots are taken, the batch lines backfill keeps in flight wait in the engine's queue, and
    four long interactive requests (priority 0) arrive behind them. When the hold is released
    the interactive requests take the four slots, and no batch line that was waiting is
    answered before one of them; under fcfs every one of them would be. The order is read
    from when the answers came back, seconds apart, not from two clocks' timestamps."""
    bodies = [chat("prio", i) for i in range(PRIO_LINES)]
    bodies.append(chat("prio", PRIO_LINES, priority=3))
    lines = [
        {"custom_id": f"prio-{i}", "method": "POST", "url": "/v1/chat/completions", "body": b}
        for i, b in enumerate(bodies)
    ]
    generate, _ = engines
    deadline = time.monotonic() + 120

    def until(condition: Any, what: str) -> None:
        while not condition():
            assert time.monotonic() < deadline, what
            time.sleep(0.02)

    def interactive(i: int) -> None:
        """One long interactive request, through the router (which notes when it passed)."""
        body = chat("live", i, max_tokens=LIVE_TOKENS, ignore_eos=True)
        r = httpx.post(f"{router.base_url}/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text

    def passed(tag: str) -> dict[str, float]:
        """When the router passed each request tagged `tag` on to the engine, by prompt."""
        return {
            json.loads(body)["messages"][0]["content"]: t for t, body in list(router.sending) if tag.encode() in body
        }

    b = client.batches.create(
        input_file_id=upload(client, jsonl(lines)).id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    until(lambda: any(b"[prio]" in body for _, body in router.sending), "the batch never reached the engine")
    with EngineHold(generate) as hold, ThreadPoolExecutor(LIVE) as pool:
        # At most HOLDERS - 4 holds wait, so the rest of the engine's queue is batch lines; and
        # at least 8 of this batch's lines are in the engine, unanswered (the queue alone could
        # also hold what an earlier test left there).
        def held_lines() -> int:
            answered = {json.dumps(e.sent) for e in list(router.exchanges) if "[prio]" in json.dumps(e.sent)}
            return sum(1 for _, body in list(router.sending) if b"[prio]" in body) - len(answered)

        until(
            lambda: waiting_in(generate) >= HOLDERS - 4 + 8 and held_lines() >= 8,
            "no batch line queued behind the hold",
        )
        lives = [pool.submit(interactive, i) for i in range(LIVE)]
        until(lambda: len(passed("[live]")) == LIVE, "the interactive requests never reached the engine")
        time.sleep(2.0)  # the hop from the router into the engine's queue (a starved API server)
        assert hold.failed() is None, hold.failed()
        released = time.time()
        hold.release()
        for f in lives:
            f.result()
    done = wait_for(client, b.id, {"completed", "failed"}, timeout_s=240)
    assert done.request_counts.completed == PRIO_LINES + 1 and done.request_counts.failed == 0
    sent = router.sent_for("/v1/chat/completions", "[prio]")
    assert sorted(x["priority"] for x in sent) == [3] + [10] * PRIO_LINES
    assert all("nvext" not in x for x in sent)
    # The order, from when the router saw each answer come back: no wall clock of the engine's.
    answers = {
        e.sent["messages"][0]["content"]: e.at
        for e in router.exchanges
        if e.path == "/v1/chat/completions" and "[prio]" in json.dumps(e.sent)
    }
    first_live = min(e.at for e in router.exchanges if "[live]" in json.dumps(e.sent))
    # The batch lines waiting when the hold was released: passed before it, answered after.
    waiting = [prompt for prompt, at in passed("[prio]").items() if at < released < answers[prompt]]
    # Under the priority policy the four interactive requests take the four slots the hold
    # leaves, and no waiting batch line runs before one of them is done (LIVE_TOKENS tokens,
    # seconds here). Under fcfs the waiting batch lines, 8 tokens each, all go first.
    early = [prompt for prompt in waiting if answers[prompt] < first_live]
    print(f"priority: {len(early)} of {len(waiting)} waiting batch lines answered before an interactive request")
    assert len(waiting) >= 8 and not early, (len(early), len(waiting))


def test_engine_errors_land_enveloped(client: openai.OpenAI) -> None:
    """A line vLLM refuses (a prompt over the model's length) goes to the error file in
    OpenAI's envelope with vLLM's own message and a request id."""
    long_prompt = "word " * 3000  # over --max-model-len 1024
    bodies = [chat("err", 0), {**chat("err", 1), "messages": [{"role": "user", "content": long_prompt}]}]
    done = run_batch(client, "/v1/chat/completions", bodies, "err")
    assert done.request_counts.completed == 1 and done.request_counts.failed == 1
    (err,) = read_lines(client, done.error_file_id)
    assert err["custom_id"] == "err-1" and err["response"]["status_code"] == 400
    assert_error_line(err, "1024")
