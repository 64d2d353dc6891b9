"""Sending a request for n choices to a fleet that ignores `n` (see `jobs.execution.n_choices`)."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from backfill.jobs.execution.n_choices import merge_choices, split_n
from backfill.jobs.execution.prefixes import PREFIX_WARM_S
from backfill.scheduler.fleet.client import FleetClient, FleetReply


async def post_request(
    fleet: FleetClient,
    endpoint: str,
    body: dict[str, Any],
    *,
    expand_n: bool | None,
    warm_s: float = PREFIX_WARM_S,
    deployment: int | None = None,
) -> FleetReply:
    """POST one batch line's body. n > 1: with `expand_n` None (auto, what drains use) the body
    goes whole and only the choices a fleet ignoring n left out are sent as more requests;
    with `expand_n` True it goes as n requests and comes back as one response. The first goes a moment ahead (PREFIX_WARM_S) so the others find the
    prompt's blocks cached. A failure of any of them is the line's failure: a transient one
    retries the whole line, so the client never gets fewer choices than it asked for.
    `deployment`: the deployment whose capacity lease the line holds (all n go there)."""
    parts = split_n(endpoint, body) if expand_n is not False else None
    if parts is None:
        return await fleet.post(endpoint, body, deployment=deployment)
    if expand_n is None:
        # Auto: the request goes as it is; a fleet that honours n answers it whole. One that
        # ignores n (the Dynamo mocker) answers with fewer choices: the missing ones are asked
        # for one by one (the prompt is cached by now) and merged after the first answer.
        whole = await fleet.post(endpoint, body, deployment=deployment)
        got = _choices(whole) if whole.status_code == 200 else None
        if got is None or got >= len(parts):
            return whole
        rest = await asyncio.gather(*(fleet.post(endpoint, part, deployment=deployment) for part in parts[got:]))
        return _merged([whole, *rest])
    first = asyncio.ensure_future(fleet.post(endpoint, parts[0], deployment=deployment))
    try:
        await asyncio.wait([first], timeout=warm_s)
        rest = await asyncio.gather(*(fleet.post(endpoint, part, deployment=deployment) for part in parts[1:]))
        replies = [await first, *rest]
    finally:
        first.cancel()  # only still running if this line was shed or its drain is stopping
    return _merged(replies)


def _choices(reply: FleetReply) -> int | None:
    """How many choices a successful answer holds (None: not a JSON object with choices)."""
    try:
        body = orjson.loads(reply.body)
    except orjson.JSONDecodeError:
        return None
    choices = body.get("choices") if isinstance(body, dict) else None
    return len(choices) if isinstance(choices, list) else None


def _merged(replies: list[FleetReply]) -> FleetReply:
    """One answer for the line: the first failure if any (a transient one first, so the line
    is retried whole), else the choices merged into one response."""
    failed = [r for r in replies if r.status_code != 200]
    if failed:
        return next((r for r in failed if r.transient), failed[0])
    try:
        merged = merge_choices([r.body for r in replies])
    except ValueError:  # not JSON objects: the fleet's answer is passed on as it came
        return replies[0]
    return FleetReply(
        status_code=200,
        body=merged,
        request_id=replies[0].request_id,
        latency_s=max(r.latency_s for r in replies),
        transient=False,
    )
