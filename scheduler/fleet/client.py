"""The fleet client: one pooled HTTP client over the fleet's deployments (its OpenAI-compatible
base URLs, `BACKFILL_FLEET_URLS`), with a circuit breaker per deployment (`scheduler.fleet.breaker`).

Each request goes to the next deployment in turn whose breaker lets it through. A request that
could not even connect is tried on the next deployment at once: it never reached the fleet, so
nothing runs twice. A request sent under a deployment's capacity lease (`deployment=`) goes to
that deployment only: refused, it comes back unsent (its line requeued without spending an
attempt) rather than land on another deployment beyond that one's limit. While no deployment will take it (circuits open, connections refused) a call
waits (at most `open_wait_s`) for a breaker to let it through: the drain backs off instead of
spending attempts on a fleet known to be down.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import math
import random
import ssl
import time
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit
from urllib.request import getproxies, proxy_bypass

import aiohttp
import orjson
import redis.asyncio

from backfill.jobs.errors import error_bytes
from backfill.scheduler.fleet.breaker import Breaker, BreakerPolicy, BreakerState, Permit, SharedBreaker, local_breaker
from backfill.scheduler.fleet.routing import FleetRoutes, Pool

log = logging.getLogger("backfill.fleet")

RETRYABLE_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})
MAX_REPLY_BYTES = 64 * 1024 * 1024
OVERFLOW_MAX_COOLDOWN_S = 120.0


@dataclass(frozen=True)
class FleetReply:
    status_code: int
    body: bytes
    request_id: str | None
    latency_s: float
    transient: bool  # worth retrying: overload, server error, timeout, connection failure
    deployment: str | None = None  # the base URL it was sent to
    # False when no deployment received the request (every circuit open, or no connection):
    # the line may go back to pending without spending an attempt.
    sent: bool = True


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One TLS context for every client of the process: loading the CA bundle costs tens of
    milliseconds, and a drain (a Celery task) makes its client afresh each time. The default
    context verifies certificates against the system's CAs (and SSL_CERT_FILE / SSL_CERT_DIR)."""
    return ssl.create_default_context()


class _BodyStalled(Exception):
    pass


class _ReplyTooLarge(Exception):
    pass


_JSON = {"Content-Type": "application/json"}


@functools.cache
def _env_proxy(base: str) -> str | None:
    """The proxy the environment names for a deployment's URL (HTTP_PROXY / HTTPS_PROXY, unless
    NO_PROXY covers its host), looked up once per URL: aiohttp's own lookup (`trust_env`) runs
    in a thread for every request."""
    parts = urlsplit(base)
    proxy = getproxies().get(parts.scheme)
    return proxy if proxy and not proxy_bypass(parts.hostname or "") else None


def _seen(done: asyncio.Future[Permit]) -> None:
    if not done.cancelled():
        done.exception()


class FleetClient:
    def __init__(
        self,
        urls: list[str],
        *,
        timeout_s: float,
        api_key: str = "",
        max_connections: int = 1024,
        redis_url: str = "",
        breaker_policy: BreakerPolicy | None = None,
        body_idle_timeout_s: float = 30.0,
        open_wait_s: float = 15.0,
        overflow_urls: list[str] | None = None,
        overflow_api_key: str = "",
        routes: FleetRoutes | None = None,
    ) -> None:
        """`timeout_s` bounds a whole exchange (a long generation may take minutes before its
        first byte); once the headers are in, the body must keep flowing: a read that brings
        nothing for `body_idle_timeout_s` ends the exchange as a stalled reply.
        With `redis_url` the breakers are shared by every worker; without, they live in this process.
        `overflow_urls` (`BACKFILL_OVERFLOW_URLS`) are deployments after the fleet's, each with a
        breaker of its own, reached only when asked for by index (escalated lines, never by turn)."""
        if not urls:
            raise ValueError("no fleet URL configured (BACKFILL_FLEET_URLS)")
        self.fleet_deployments = len(urls)
        self._urls = [*urls, *(overflow_urls or [])]
        # Credentials are per deployment: the fleet's key to the fleet's deployments, the
        # overflow's own (a serverless pool, another provider) to the overflow's; no key, no header.
        self._auth = {
            i: {"Authorization": f"Bearer {key}"}
            for i in range(len(self._urls))
            if (key := api_key if i < len(urls) else overflow_api_key)
        }
        self._turn = itertools.count()
        # Which deployments serve which model: a call not pinned to a deployment fails over only
        # among those serving its body's model (None: every deployment serves every model).
        self.routes = routes
        self._asking: dict[tuple[int, str | None], asyncio.Future[Permit]] = {}  # a breaker's question in flight
        self._timeout_s = timeout_s
        self._body_idle_s = min(body_idle_timeout_s, timeout_s)
        self._open_wait_s = open_wait_s
        policy = breaker_policy or BreakerPolicy()
        # An overflow that keeps refusing is asked less and less often (a probe each cool-down,
        # doubled by each failed probe); the fleet's own deployments keep the plain cool-down.
        overflow_policy = replace(policy, max_cooldown_s=max(policy.max_cooldown_s, OVERFLOW_MAX_COOLDOWN_S))
        self._redis = (
            redis.asyncio.Redis.from_url(
                redis_url, decode_responses=True, socket_timeout=2.0, socket_connect_timeout=2.0
            )
            if redis_url
            else None
        )
        self.breakers: list[Breaker] = [
            SharedBreaker(self._redis, url, p) if self._redis is not None else local_breaker(url, p)
            for i, url in enumerate(self._urls)
            for p in [policy if i < len(urls) else overflow_policy]
        ]
        # A deployment serving several models has a breaker per model as well (made when first
        # needed, named `url#model`): one model's failing workers open its own circuit only.
        self._model_breakers: dict[tuple[int, str], Breaker] = {}
        # One aiohttp session for every call, made on first use (it belongs to the running event
        # loop). aiohttp rather than httpx: a request cost the drain ~1.2 ms of CPU through httpx
        # (its request and response models, cookies, anyio's cancel scopes, and httpcore polling
        # each pooled connection) against ~0.25 ms through aiohttp's C parser (docs/benchmarks.md,
        # "What a line costs backfill"). Cookies are not kept: a fleet's replies share nothing.
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    @property
    def deployments(self) -> int:
        return len(self._urls)

    async def states(self) -> list[BreakerState]:
        """Each deployment's circuit, as every worker sees it."""
        return [await b.state() for b in self.breakers]

    def breaker(self, i: int, model: str | None = None) -> Breaker:
        """The breaker a call of `model` to deployment i answers to: its model's where a fleet
        deployment serves several (`FleetRoutes.pool`), else the deployment's. An overflow keeps
        one breaker: what makes it fail (its keys, its quota, its rate limit) is the provider's."""
        routed = self.routes is not None and i < min(len(self.routes.urls), self.fleet_deployments)
        pool = self.routes.pool(i, model) if self.routes is not None and routed else Pool(i)
        if pool.model is None:
            return self.breakers[i]
        key = (i, pool.model)
        made = self._model_breakers.get(key)
        if made is None:
            name, policy = f"{self._urls[i]}#{pool.model}", self.breakers[i].policy
            made = SharedBreaker(self._redis, name, policy) if self._redis is not None else local_breaker(name, policy)
            self._model_breakers[key] = made
        return made

    async def pool_states(self, pools: list[Pool]) -> dict[Pool, BreakerState]:
        """Each pool's circuit: a model's pool on a deployment serving several has its own."""
        return {p: await self.breaker(p.deployment, p.model).state() for p in pools}

    async def post(self, endpoint: str, body: dict[str, Any], *, deployment: int | None = None) -> FleetReply:
        """POST a batch line's body to the same path on a deployment (`/v1/...` under its base URL);
        with `deployment`, on that one only."""
        path = endpoint[len("/v1") :] if endpoint.startswith("/v1/") else endpoint
        payload = orjson.dumps(body)
        started = time.monotonic()
        give_up_at = started + self._open_wait_s
        # Deployments that refused this request's connection (or that it may not go to).
        # Overflow deployments take only the calls sent to them by index.
        everyone = set(range(len(self._urls)))
        refused = everyone - set(range(self.fleet_deployments)) if deployment is None else everyone - {deployment}
        if deployment is None and self.routes is not None:
            model = body.get("model")
            refused |= {i for i in everyone if not self.routes.serves(i, model if isinstance(model, str) else None)}
        last: FleetReply | None = None
        model = body.get("model") if isinstance(body.get("model"), str) else None
        while True:
            picked, wait_s = await self._pick(skip=refused, model=model)
            if picked is None:
                left = give_up_at - time.monotonic()
                if len(refused) == len(self._urls) or left <= 0:
                    # Nothing reached the fleet: every deployment refused it or kept its circuit open.
                    return last or self._synthetic(
                        503, "every fleet deployment's circuit is open", started, deployment=None, sent=False
                    )
                # Jittered, so the waiting calls do not all ask again at the same instant.
                await asyncio.sleep(max(0.05, min(wait_s, left, 1.0)) * random.uniform(1.0, 1.3))
                continue
            i, permit = picked
            reply, connected = await self._exchange(self._urls[i], path, payload, self._auth.get(i))
            await self._report(i, permit, reply, model)
            if connected or deployment is not None:
                return reply
            refused.add(i)
            last = reply

    async def _pick(self, *, skip: set[int], model: str | None = None) -> tuple[tuple[int, Permit] | None, float]:
        """The next deployment in turn whose breaker lets a call through, else how long until one might."""
        n = len(self._urls)
        start = next(self._turn) % n
        soonest = math.inf
        for k in range(n):
            i = (start + k) % n
            if i in skip:
                continue
            permit = await self._allow(i, model)
            if permit.allowed:
                return (i, permit), 0.0
            soonest = min(soonest, permit.retry_after_s)
        return None, soonest

    async def _allow(self, i: int, model: str | None = None) -> Permit:
        """Ask deployment i's breaker, sharing a question already in flight: a claim launches
        its lines at once, and each would otherwise ask Redis the same thing in the same
        millisecond. Only a plain pass is shared (the circuit closed: it was read while this
        call was already waiting, as if asked just before); a probe is one caller's alone, and a
        refusal is asked again, so the half-open state still lets one call through at a time."""
        breaker = self.breaker(i, model)
        key = (i, model if breaker is not self.breakers[i] else None)
        if self._redis is None:  # a breaker in this process answers at once: nothing to share
            return await breaker.allow()
        shared = self._asking.get(key)
        if shared is not None:
            try:
                # Shielded: a caller shed meanwhile must not cancel the question for the others.
                permit = await asyncio.shield(shared)
            except Exception:  # noqa: BLE001 - the asker's failure is its own; ask afresh below
                permit = Permit(False)
            if permit.allowed and not permit.probe:
                return permit
        asked = asyncio.ensure_future(breaker.allow())
        asked.add_done_callback(_seen)  # its failure is retrieved even if every asker was shed
        self._asking[key] = asked
        try:
            return await asyncio.shield(asked)
        finally:
            if self._asking.get(key) is asked:
                del self._asking[key]

    async def _report(self, i: int, permit: Permit, reply: FleetReply, model: str | None = None) -> None:
        # A fleet deployment fails by its server errors (its 4xx judge the line); an overflow
        # deployment by any refusal: its auth, its model list and its rate limit are its own.
        overflow = i >= self.fleet_deployments
        failed = (reply.transient and reply.status_code >= 500) or (overflow and reply.status_code >= 400)
        breaker = self.breaker(i, model)
        changed = await breaker.record(ok=not failed, probe=permit.probe, sent_s_ago=reply.latency_s)
        if changed is BreakerState.open:
            log.warning("fleet deployment %s: circuit opened (last reply %d)", breaker.name, reply.status_code)
        elif changed is BreakerState.closed:
            log.info("fleet deployment %s: circuit closed, the probe succeeded", breaker.name)

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._max_connections, limit_per_host=0, ssl=_tls_context()),
                cookie_jar=aiohttp.DummyCookieJar(),
                # The whole exchange is bounded by `_exchange`'s own timeout; the connect is bounded here.
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=min(10.0, self._timeout_s)),
            )
        return self._session

    async def _exchange(
        self, base: str, path: str, payload: bytes, auth: dict[str, str] | None = None
    ) -> tuple[FleetReply, bool]:
        """One POST to one deployment; the flag says whether a connection was made at all."""
        started = time.monotonic()
        headers = {"Content-Type": "application/json", **auth} if auth else _JSON
        try:
            async with asyncio.timeout(self._timeout_s):
                post = self._client().post(base + path, data=payload, headers=headers, proxy=_env_proxy(base))
                async with post as resp:
                    body = await self._read_body(resp.content)
                    status, request_id = resp.status, resp.headers.get("x-request-id")
        except _BodyStalled:
            msg = f"fleet reply body stalled for {self._body_idle_s:g} s"
            return self._synthetic(504, msg, started, deployment=base), True
        except _ReplyTooLarge:
            msg = f"fleet reply larger than {MAX_REPLY_BYTES} bytes"
            return self._synthetic(502, msg, started, deployment=base, transient=False), True
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            # No connection was made (refused, no route, the name not found, TLS refused, the
            # connect timed out): the request reached nothing.
            msg = f"fleet connection error: {exc!r}"
            return self._synthetic(503, msg, started, deployment=base, sent=False), False
        except TimeoutError as exc:
            return self._synthetic(504, f"fleet timeout: {exc!r}", started, deployment=base), True
        except aiohttp.ClientError as exc:  # dropped mid-exchange, a malformed reply, a bad URL
            return self._synthetic(503, f"fleet connection error: {exc!r}", started, deployment=base), True
        reply = FleetReply(
            status_code=status,
            body=body,
            request_id=request_id,
            latency_s=time.monotonic() - started,
            transient=status in RETRYABLE_STATUS,
            deployment=base,
        )
        return reply, True

    async def _read_body(self, stream: aiohttp.StreamReader) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            # What has arrived already is taken without arming a timer (a small reply is whole by
            # the time its headers are parsed); only a wait for more is bounded by the idle timeout.
            chunk = stream.read_nowait()
            if not chunk and not stream.at_eof():
                try:
                    async with asyncio.timeout(self._body_idle_s):
                        chunk = await stream.readany()
                except TimeoutError as exc:
                    raise _BodyStalled from exc
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            if size > MAX_REPLY_BYTES:
                raise _ReplyTooLarge
            chunks.append(chunk)

    @staticmethod
    def _synthetic(
        status: int,
        message: str,
        started: float,
        *,
        deployment: str | None,
        transient: bool = True,
        sent: bool = True,
    ) -> FleetReply:
        body = error_bytes(message, type_="fleet_unreachable")
        return FleetReply(status, body, None, time.monotonic() - started, transient, deployment, sent)

    async def aclose(self) -> None:
        for breaker in [*self.breakers, *self._model_breakers.values()]:
            await breaker.flush()
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._redis is not None:
            await self._redis.aclose()


# Routing hints backfill adds to a batch line's body on its way to the fleet, so the fleet
# serves it behind interactive traffic. Nothing else of the client's body is touched.


def add_routing_hints(body: dict[str, Any], mode: str) -> dict[str, Any]:
    """`nvext`: Dynamo's agent hints (a low priority); `vllm`: vLLM's priority (a larger value is
    served later); anything else: the body as it is."""
    if mode == "nvext":
        nvext = dict(body.get("nvext") or {})
        hints = dict(nvext.get("agent_hints") or {})
        hints.setdefault("priority", -10)
        nvext["agent_hints"] = hints
        return {**body, "nvext": nvext}
    if mode == "vllm":
        return {**body, "priority": body.get("priority", 10)}
    return body
