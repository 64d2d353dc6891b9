"""The extension routes for following and planning batches, in-process on Postgres, with team
keys: a batch's cost so far (`GET /v1/batches/{id}/cost`), the price in force now
(`GET /v1/batch_price`) and the fleet's batch throughput (`GET /v1/batch_throughput`)."""

from __future__ import annotations

import json
import secrets

import pytest

from backfill.api.protocol import BatchCost, BatchThroughput, Price
from backfill.api.wire import batch_id_in
from backfill.jobs.billing.ledger import Rates, format_micros, price_request
from backfill.jobs.execution.claims import claim_requests
from backfill.jobs.execution.replies import Outcome, Usage
from backfill.jobs.execution.results import record_outcomes
from backfill.jobs.validation.outcome import apply_validation
from backfill.jobs.validation.scan import Limits, validate_lines
from backfill.storage.db import unit_of_work
from tests.api.conftest import CheckedClient, Team
from tests.api.test_files import upload

TOKEN = "forecast-test-claim"
LINES = 3


def _model() -> str:
    """A model of this test only: the package's tests share one database."""
    return f"fc-{secrets.token_hex(4)}"


def _input(model: str) -> bytes:
    lines = [
        {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 4},
        }
        for i in range(1, LINES + 1)
    ]
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def _running_batch(api: CheckedClient, team: Team, model: str, window: str = "24h") -> tuple[str, str, int]:
    """A batch validated in-process, every line claimed by TOKEN: (wire id, id, token estimate)."""
    data = _input(model)
    f = upload(api, team, data=data)
    r = api.post(
        "/v1/batches",
        headers=team.headers,
        json={"input_file_id": f["id"], "endpoint": "/v1/chat/completions", "completion_window": window},
    )
    assert r.status_code == 200, r.text
    wire_id = r.json()["id"]
    batch_id = batch_id_in(wire_id)
    result = validate_lines(
        [data], endpoint="/v1/chat/completions", served_models=None, limits=Limits(100, 1 << 20, 10)
    )
    with unit_of_work() as session:
        assert apply_validation(session, batch_id=batch_id, result=result) == "in_progress"
    with unit_of_work() as session:
        assert len(claim_requests(session, batch_id=batch_id, limit=LINES, claim_token=TOKEN)) == LINES
    return wire_id, batch_id, result.token_estimate


def _record(batch_id: str, *results: tuple[int, Outcome]) -> None:
    with unit_of_work() as session:
        assert record_outcomes(session, claim_token=TOKEN, results=[(batch_id, n, o) for n, o in results]) == len(
            results
        )


def _ok(prompt: int, cached: int, completion: int) -> Outcome:
    return Outcome(200, b'{"choices": []}', "r", Usage(prompt, cached, completion))


def _failed() -> Outcome:
    return Outcome(400, b'{"error": {"message": "bad"}}', "r", Usage(9, 0, 0))


def _set_price(api: CheckedClient, admin: dict[str, str], model: str, **fields: object) -> dict[str, object]:
    body = {"model": model, "input": "0.15", "cached_input": "0.075", "output": "0.60", **fields}
    r = api.post("/v1/organization/prices", headers=admin, json=body)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_cost_so_far_with_a_team_key(
    api: CheckedClient, team: Team, other_team: Team, admin_headers: dict[str, str]
) -> None:
    model = _model()
    price = _set_price(api, admin_headers, model)
    wire_id, batch_id, _ = _running_batch(api, team, model)
    path = f"/v1/batches/{wire_id}/cost"
    # A team key may not read the price list, but may read what its batch costs.
    assert api.get("/v1/organization/prices", headers=team.headers).status_code == 403

    start = api.get(path, headers=team.headers)
    assert start.status_code == 200, start.text
    assert start.json() == {
        "object": "batch.cost",
        "batch_id": wire_id,
        "amount": "0.000000",
        "currency": "usd",
        "price_id": price["id"],
        "requests": 0,
        "input_tokens": 0,
        "cached_tokens": 0,
        "output_tokens": 0,
    }

    _record(batch_id, (1, _ok(120_000, 20_000, 3_000)), (2, _failed()))
    rates = Rates(input=150_000, cached_input=75_000, output=600_000)
    expected = price_request(rates, prompt_tokens=120_000, cached_tokens=20_000, completion_tokens=3_000)
    cost = BatchCost.model_validate(api.get(path, headers=team.headers).json())
    assert cost.amount == format_micros(expected.total_micros) == "0.009150"
    assert (cost.requests, cost.input_tokens, cost.cached_tokens, cost.output_tokens) == (1, 120_000, 20_000, 3_000)
    # The same totals as the batch's own usage.
    usage = api.get(f"/v1/batches/{wire_id}", headers=team.headers).json()["usage"]
    assert (usage["input_tokens"], usage["output_tokens"]) == (cost.input_tokens, cost.output_tokens)

    _record(batch_id, (3, _ok(10_000, 0, 1_000)))  # 750 + 300 micros more
    more = BatchCost.model_validate(api.get(path, headers=team.headers).json())
    assert (more.requests, more.amount) == (2, "0.010200")


@pytest.mark.parametrize("wire_id", ["batch_doesnotexist", "nope"])
def test_cost_of_unknown_batch_is_the_batches_404(api: CheckedClient, team: Team, wire_id: str) -> None:
    cost = api.get(f"/v1/batches/{wire_id}/cost", headers=team.headers)
    batch = api.get(f"/v1/batches/{wire_id}", headers=team.headers)
    assert cost.status_code == batch.status_code == 404
    assert cost.json() == batch.json()


def test_cost_of_another_teams_batch_is_a_404_like_unknown(
    api: CheckedClient, team: Team, other_team: Team, admin_headers: dict[str, str]
) -> None:
    model = _model()
    wire_id, _, _ = _running_batch(api, team, model)
    theirs = api.get(f"/v1/batches/{wire_id}/cost", headers=other_team.headers)
    assert theirs.status_code == 404
    assert theirs.json() == api.get(f"/v1/batches/{wire_id}", headers=other_team.headers).json()
    assert theirs.json()["error"] == {
        "message": f"No batch found with id '{wire_id}'.",  # the id the client sent
        "type": "invalid_request_error",
        "param": "batch_id",
        "code": "not_found",
    }
    # No price was in force for the model: the batch is billed at zero, and says so.
    own = api.get(f"/v1/batches/{wire_id}/cost", headers=team.headers).json()
    assert own["price_id"] is None and own["amount"] == "0.000000"


def test_price_in_force_with_a_team_key(api: CheckedClient, team: Team, admin_headers: dict[str, str]) -> None:
    model = _model()
    missing = api.get("/v1/batch_price", headers=team.headers, params={"model": model})
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "price_not_found" and missing.json()["error"]["param"] == "model"

    general = _set_price(api, admin_headers, model)
    hour = _set_price(api, admin_headers, model, completion_window="1h", output="0.50")
    _set_price(api, admin_headers, model, effective_from=2**31 - 1, output="9")  # not yet in force

    day = api.get("/v1/batch_price", headers=team.headers, params={"model": model})
    assert day.status_code == 200, day.text
    assert day.json() == general  # the organization's price object, as an admin lists it
    Price.model_validate(day.json())
    one_hour = api.get("/v1/batch_price", headers=team.headers, params={"model": model, "completion_window": "1h"})
    assert one_hour.json() == hour  # the window's own price wins

    # What the ledger bills a batch created now with: the same price row.
    wire_id, _, _ = _running_batch(api, team, model)
    assert api.get(f"/v1/batches/{wire_id}/cost", headers=team.headers).json()["price_id"] == general["id"]

    bad_window = api.get("/v1/batch_price", headers=team.headers, params={"model": model, "completion_window": "3d"})
    assert bad_window.status_code == 400 and bad_window.json()["error"]["param"] == "completion_window"
    no_model = api.get("/v1/batch_price", headers=team.headers)
    assert no_model.status_code == 400 and no_model.json()["error"]["param"] == "model"
    control = api.get("/v1/batch_price", headers=team.headers, params={"model": "a\x00b"})
    assert control.status_code == 400 and control.json()["error"]["param"] == "model"
    assert api.get("/v1/batch_price", params={"model": model}).status_code == 401


def test_throughput_and_queue_are_aggregates(api: CheckedClient, team: Team, other_team: Team) -> None:
    model = _model()

    def read(key_of: Team, **params: object) -> BatchThroughput:
        r = api.get("/v1/batch_throughput", headers=key_of.headers, params=params)
        assert r.status_code == 200, r.text
        # Aggregate figures only: nothing names a team, a batch or a key.
        assert set(r.json()) == set(BatchThroughput.model_fields)
        return BatchThroughput.model_validate(r.json())

    idle = read(team, model=model)
    assert (idle.requests, idle.tokens, idle.tokens_per_second, idle.queued_requests, idle.running_batches) == (
        0,
        0,
        0.0,
        0,
        0,
    )
    assert idle.window_s == 300 and idle.model == model and idle.busy_s == 0 and idle.busy_tokens_per_second == 0

    _, batch_id, estimate = _running_batch(api, team, model)
    queued = read(other_team, model=model)  # another team sees the fleet's queue, not whose it is
    assert (queued.queued_requests, queued.queued_tokens, queued.running_batches) == (LINES, estimate, 1)

    _record(batch_id, (1, _ok(30, 0, 4)), (2, _failed()))
    busy = read(team, model=model, window_s=60)
    assert (busy.requests, busy.tokens, busy.window_s) == (1, 34, 60)
    assert busy.tokens_per_second == 34 / 60 and busy.requests_per_second == 1 / 60
    # Recorded in one transaction: busy for one 10 s step of the window.
    assert busy.busy_s == 10 and busy.busy_tokens_per_second == 3.4 and busy.busy_requests_per_second == 0.1
    assert busy.queued_requests == 1 and 0 < busy.queued_tokens < estimate
    assert read(other_team, model=model, window_s=60).model_dump(exclude={"at"}) == busy.model_dump(exclude={"at"})

    everything = read(team)
    assert everything.model is None and everything.requests >= 1 and everything.tokens >= 34

    for window in (5, 3601):
        r = api.get("/v1/batch_throughput", headers=team.headers, params={"window_s": window})
        assert r.status_code == 400 and r.json()["error"]["param"] == "window_s"
    assert api.get("/v1/batch_throughput").status_code == 401


def test_the_routes_are_in_the_openapi_document(api: CheckedClient) -> None:
    document = api.fastapi_app.openapi()
    for path, schema, params in (
        ("/v1/batches/{batch_id}/cost", "BatchCost", {"batch_id"}),
        ("/v1/batch_price", "Price", {"model", "completion_window"}),
        ("/v1/batch_throughput", "BatchThroughput", {"window_s", "model"}),
    ):
        assert set(document["paths"][path]) == {"get"}, path
        operation = document["paths"][path]["get"]
        assert operation["responses"]["200"]["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{schema}"
        }
        for status in ("400", "401", "404"):
            error = operation["responses"][status]["content"]["application/json"]["schema"]
            assert error == {"$ref": "#/components/schemas/ErrorResponse"}
        assert {p["name"] for p in operation["parameters"]} == params
        assert operation["description"]  # the docstring says what it returns
    schemas = document["components"]["schemas"]
    assert schemas["BatchCost"]["required"] == list(BatchCost.model_fields)
    assert schemas["BatchThroughput"]["required"] == list(BatchThroughput.model_fields)
    # The OpenAI Batches routes are as they were: these are new paths beside them.
    assert set(document["paths"]["/v1/batches/{batch_id}"]) == {"get"}
    assert set(document["paths"]["/v1/batches"]) == {"get", "post"}
