"""Completion windows through the API, in-process on Postgres (the package's settings accept
24h and 1h; the price multipliers are the defaults, 1h = 2x): a batch in each window expires
that long after its creation, an unknown window is OpenAI's 400, and the price routes and the
cost route say what a window costs."""

from __future__ import annotations

from typing import Any

from backfill.api.protocol import BatchWindowPriceList, Price
from backfill.api.wire import batch_id_in
from tests.api.conftest import CheckedClient, Team
from tests.api.test_files import upload
from tests.api.test_forecast_routes import _model, _ok, _record, _running_batch, _set_price

CHAT = "/v1/chat/completions"


def _create(api: CheckedClient, team: Team, window: Any) -> Any:
    f = upload(api, team, data=b"")
    return api.post(
        "/v1/batches",
        headers=team.headers,
        json={"input_file_id": f["id"], "endpoint": CHAT, "completion_window": window},
    )


def test_each_accepted_window_sets_expires_at(api: CheckedClient, team: Team) -> None:
    for window, seconds in (("1h", 3600), ("24h", 86400)):
        r = _create(api, team, window)
        assert r.status_code == 200, r.text
        batch = r.json()
        assert batch["completion_window"] == window
        assert batch["expires_at"] - batch["created_at"] == seconds


def test_an_unknown_window_is_a_400_in_openais_envelope(api: CheckedClient, team: Team) -> None:
    for window in ("3d", "7d", "24H", " 1h", ""):
        r = _create(api, team, window)
        assert r.status_code == 400, r.text
        assert r.json() == {
            "error": {
                "message": f"Invalid value: {window!r}. Supported values are: '1h', '24h'.",
                "type": "invalid_request_error",
                "param": "completion_window",
                "code": "invalid_value",
            }
        }
    r = _create(api, team, 24)  # not a string at all: the body's own check, same envelope
    assert r.status_code == 400 and r.json()["error"]["param"] == "completion_window"
    priced = api.get("/v1/batch_price", headers=team.headers, params={"model": "m", "completion_window": "3d"})
    assert priced.status_code == 400 and priced.json()["error"]["code"] == "invalid_value"


def test_the_create_body_documents_the_accepted_set(api: CheckedClient) -> None:
    schema = api.fastapi_app.openapi()["components"]["schemas"]["CreateBatchBody"]["properties"]["completion_window"]
    assert schema["type"] == "string" and schema["enum"] == ["1h", "24h"]


def test_prices_per_window(api: CheckedClient, team: Team, admin_headers: dict[str, str]) -> None:
    model = _model()
    missing = api.get("/v1/batch_prices", headers=team.headers, params={"model": model})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "price_not_found"

    general = _set_price(api, admin_headers, model)  # 0.15 / 0.075 / 0.60
    table = BatchWindowPriceList.model_validate(
        api.get("/v1/batch_prices", headers=team.headers, params={"model": model}).json()
    )
    assert [
        (
            p.completion_window,
            p.window_seconds,
            p.priced_by,
            p.multiplier,
            p.price_id,
            p.input,
            p.cached_input,
            p.output,
        )
        for p in table.data
    ] == [
        ("1h", 3600, "general", "2.0", general["id"], "0.300000", "0.150000", "1.200000"),
        ("24h", 86400, "general", "1.0", general["id"], "0.150000", "0.075000", "0.600000"),
    ]
    # /batch_price says the same: the general row, at the window's amounts.
    hour = Price.model_validate(
        api.get("/v1/batch_price", headers=team.headers, params={"model": model, "completion_window": "1h"}).json()
    )
    assert (hour.id, hour.completion_window, hour.input, hour.cached_input, hour.output) == (
        general["id"],
        None,
        "0.300000",
        "0.150000",
        "1.200000",
    )
    day = api.get("/v1/batch_price", headers=team.headers, params={"model": model, "completion_window": "24h"})
    assert day.json() == general

    # A window's own price wins and is not scaled.
    own = _set_price(api, admin_headers, model, completion_window="1h", output="0.90")
    first = api.get("/v1/batch_prices", headers=team.headers, params={"model": model}).json()["data"][0]
    assert (first["priced_by"], first["multiplier"], first["price_id"], first["output"]) == (
        "window",
        "1",
        own["id"],
        "0.900000",
    )


def test_a_1h_batch_costs_the_1h_price(api: CheckedClient, team: Team, admin_headers: dict[str, str]) -> None:
    model = _model()
    general = _set_price(api, admin_headers, model)
    wire_id, batch_id, _ = _running_batch(api, team, model, window="1h")
    assert batch_id == batch_id_in(wire_id)
    _record(batch_id, (1, _ok(120_000, 20_000, 3_000)))
    cost = api.get(f"/v1/batches/{wire_id}/cost", headers=team.headers).json()
    # At 24h the same request costs 0.009150 (test_forecast_routes): twice that, rounded per component.
    assert (cost["amount"], cost["price_id"]) == ("0.018300", general["id"])
