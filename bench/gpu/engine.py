"""A small OpenAI-compatible server over transformers' continuous batching, for the GPU bench.

Why not `transformers serve`: it refuses request fields outside OpenAI's schema and cannot
ignore EOS per request; vLLM is not installed where the bench runs. This server answers
`GET /v1/models`, `POST /v1/chat/completions` and `POST /v1/completions` (with `usage`) from
one `ContinuousBatchingManager`, ignoring EOS always (every request generates exactly its
`max_tokens`), accepting and ignoring fields it does not use (`nvext`, `ignore_eos`, ...).

The model has random weights in a realistic shape (`--shape llama-3.2-1b`), built on the
device from its configuration; the tokenizer is the development fleet's locally trained one
(`--tokenizer DIR`). Its vocabulary is smaller than the model's, so generated ids are decoded
modulo the tokenizer's size: the text is noise either way, its cost realistic.

Bench endpoints beside the API:
- `GET /metrics`: `vllm:num_requests_running` / `vllm:num_requests_waiting` (vLLM's names, so
  the bench gauges read it as they read vLLM);
- `POST /bench/offline`: the same request bodies submitted straight to the manager, all at
  once, no HTTP per request: the engine's own batch throughput;
- `GET /bench/stats?reset=1`: requests served, tokens, requests in flight at the server (max
  and time-weighted mean over the busy window), first arrival and last reply (Unix seconds).

    python -m bench.gpu.engine --tokenizer DIR --shape llama-3.2-1b --device cuda --port 8100
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

# Llama-3.2-1B's geometry (its config.json), without the weights.
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
    },
    # For the CPU test: the same code path in a model of a few million parameters.
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 4096,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    },
}


@dataclass
class Stats:
    """Requests in flight at the server over time, integrated between arrivals and replies."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    inflight: int = 0
    inflight_max: int = 0
    area: float = 0.0  # sum of inflight * dt over the busy window
    first_at: float | None = None
    last_at: float | None = None
    _since: float = field(default_factory=time.time)

    def _advance(self, now: float) -> None:
        if self.first_at is not None:
            self.area += self.inflight * (now - self._since)
        self._since = now

    def arrive(self) -> None:
        now = time.time()
        self._advance(now)
        if self.first_at is None:
            self.first_at = now
        self.inflight += 1
        self.inflight_max = max(self.inflight_max, self.inflight)

    def leave(self, prompt_tokens: int, completion_tokens: int) -> None:
        now = time.time()
        self._advance(now)
        self.inflight -= 1
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        self.last_at = now

    def snapshot(self) -> dict[str, Any]:
        busy = (self.last_at - self.first_at) if self.first_at is not None and self.last_at is not None else 0.0
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "inflight_now": self.inflight,
            "inflight_max": self.inflight_max,
            "inflight_mean": self.area / busy if busy > 0 else 0.0,
            "first_at": self.first_at,
            "last_at": self.last_at,
        }


class Engine:
    """One manager, its results routed to the asyncio futures that wait for them."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM
        from transformers.generation import ContinuousBatchingConfig

        self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        self.tok_vocab = len(self.tokenizer)
        self.model_id = args.model_id
        dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
        config = LlamaConfig(**SHAPES[args.shape], bos_token_id=1, eos_token_id=None, pad_token_id=0)
        torch.manual_seed(0)
        with torch.device(args.device):
            model = LlamaForCausalLM._from_config(config, dtype=dtype, attn_implementation="sdpa")
        self.model = model.eval()
        generation = GenerationConfig(
            max_new_tokens=args.max_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0, bos_token_id=1
        )
        cb: dict[str, Any] = {}
        if args.device == "cpu":
            # On CPU the cache would be sized from the host's whole memory: give it a size.
            cb = {"num_blocks": args.num_blocks, "max_batch_tokens": args.max_batch_tokens}
        else:
            cb = {"max_memory_percent": args.kv_memory}
        if not args.cuda_graph:
            cb["use_cuda_graph"] = False
        self.manager = model.init_continuous_batching(
            generation_config=generation, continuous_batching_config=ContinuousBatchingConfig(**cb)
        )
        if args.warmup and hasattr(self.manager, "warmup"):
            self.manager.warmup()
        self.manager.start()
        self.waiting: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]] = {}
        self.lock = threading.Lock()
        self.stats = Stats()
        self.stopping = threading.Event()
        self.router = threading.Thread(target=self._route, name="results", daemon=True)
        self.router.start()

    def _route(self) -> None:
        while not self.stopping.is_set():
            out = self.manager.get_result(timeout=0.05)
            if out is None:
                if not self.manager.is_running():
                    self._fail_all(RuntimeError("the generation thread stopped"))
                    return
                continue
            if not out.is_finished():
                continue
            with self.lock:
                waiter = self.waiting.pop(out.request_id, None)
            if waiter is not None:
                loop, fut = waiter
                loop.call_soon_threadsafe(_settle, fut, out)

    def _fail_all(self, error: Exception) -> None:
        with self.lock:
            waiters, self.waiting = self.waiting, {}
        for loop, fut in waiters.values():
            loop.call_soon_threadsafe(_fail, fut, error)

    def prompt_ids(self, body: dict[str, Any], chat: bool) -> list[int]:
        if chat:
            text = self.tokenizer.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
        else:
            text = body["prompt"] if isinstance(body["prompt"], str) else "".join(body["prompt"])
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    async def generate(self, ids: list[int], max_tokens: int) -> Any:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        request_id = uuid.uuid4().hex
        with self.lock:
            self.waiting[request_id] = (loop, fut)
        self.manager.add_request(ids, request_id=request_id, max_new_tokens=max_tokens, eos_token_id=-1)
        return await fut

    def text(self, tokens: list[int]) -> str:
        return str(self.tokenizer.decode([t % self.tok_vocab for t in tokens], skip_special_tokens=True))

    def gauges(self) -> tuple[int, int]:
        processor = getattr(self.manager, "batch_processor", None)
        scheduler = getattr(processor, "scheduler", None)
        running = len(getattr(scheduler, "active_requests", {}) or {})
        waiting = len(getattr(scheduler, "waiting_requests", {}) or {}) + self.manager.input_queue.qsize()
        return running, waiting

    def stop(self) -> None:
        self.stopping.set()
        self.manager.stop(block=True, timeout=10)


def _settle(fut: asyncio.Future[Any], out: Any) -> None:
    if not fut.done():
        fut.set_result(out)


def _fail(fut: asyncio.Future[Any], error: Exception) -> None:
    if not fut.done():
        fut.set_exception(error)


def max_tokens_of(body: dict[str, Any], default: int) -> int:
    value = body.get("max_completion_tokens") or body.get("max_tokens") or default
    return int(value)


def build_app(engine: Engine) -> FastAPI:
    app = FastAPI()
    default_max = engine.manager.generation_config.max_new_tokens

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": engine.model_id, "object": "model", "created": 0, "owned_by": "bench"}],
        }

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    async def complete(request: Request, chat: bool) -> JSONResponse:
        body = await request.json()
        if body.get("model") != engine.model_id:
            error = {"message": f"model {body.get('model')!r} not served", "type": "invalid_request_error"}
            return JSONResponse({"error": {**error, "param": "model", "code": "model_not_found"}}, status_code=404)
        engine.stats.arrive()
        ids: list[int] = []
        tokens: list[int] = []
        try:
            ids = engine.prompt_ids(body, chat)
            out = await engine.generate(ids, max_tokens_of(body, default_max))
            if out.error:
                raise RuntimeError(out.error)
            tokens = list(out.generated_tokens)
        finally:
            engine.stats.leave(len(ids), len(tokens))
        text = engine.text(tokens)
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(tokens), "total_tokens": len(ids) + len(tokens)}
        return JSONResponse(
            {
                "id": f"cmpl-{uuid.uuid4().hex}",
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": engine.model_id,
                "choices": [choice],
                "usage": usage,
            }
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> JSONResponse:
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        return await complete(request, chat=False)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        running, waiting = engine.gauges()
        return PlainTextResponse(
            f"vllm:num_requests_running {running}\nvllm:num_requests_waiting {waiting}\n",
            media_type="text/plain; version=0.0.4",
        )

    @app.get("/bench/stats")
    async def stats(reset: int = 0) -> dict[str, Any]:
        snap = engine.stats.snapshot()
        if reset:
            engine.stats = Stats()
        return snap

    @app.post("/bench/offline")
    async def offline(request: Request) -> dict[str, Any]:
        """Every body at once into the manager: no HTTP, no client, the engine alone."""
        bodies = (await request.json())["bodies"]
        prompts = [(engine.prompt_ids(b, "messages" in b), max_tokens_of(b, default_max)) for b in bodies]
        started = time.perf_counter()
        outs = await asyncio.gather(*(engine.generate(ids, n) for ids, n in prompts))
        elapsed = time.perf_counter() - started
        generated = sum(len(o.generated_tokens) for o in outs)
        return {
            "requests": len(outs),
            "seconds": elapsed,
            "prompt_tokens": sum(len(ids) for ids, _ in prompts),
            "completion_tokens": generated,
            "errors": sum(1 for o in outs if o.error),
        }

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True, help="a tokenizer directory (devfleet.model's build)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--model-id", default="llama-3.2-1b-random")
    parser.add_argument("--max-tokens", type=int, default=128, help="when a request names none")
    parser.add_argument("--kv-memory", type=float, default=0.5, help="share of free GPU memory for the KV cache")
    parser.add_argument("--num-blocks", type=int, default=256, help="KV blocks on CPU")
    parser.add_argument("--max-batch-tokens", type=int, default=2048, help="tokens per step on CPU")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false")
    parser.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false", help="(the fallback start)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(message)s")
    import uvicorn

    started = time.perf_counter()
    engine = Engine(args)
    logging.info("engine ready in %.1f s (%s on %s)", time.perf_counter() - started, args.shape, args.device)
    try:
        uvicorn.run(build_app(engine), host="127.0.0.1", port=args.port, log_level="warning", access_log=False)
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
