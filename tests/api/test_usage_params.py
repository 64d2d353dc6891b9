"""Query values the usage and costs routes cannot use answer 400 in OpenAI's envelope, never a
500: digits of other scripts in the page cursor, times at the edge of what a date can hold."""

from __future__ import annotations

import pytest

from tests.api.conftest import CheckedClient, Team

YEAR_9999_DEC_30 = 253402128000
LAST_SECOND_OF_9999 = 253402300799


@pytest.mark.parametrize("route", ["/v1/organization/usage/completions", "/v1/organization/costs"])
@pytest.mark.parametrize(
    "params",
    [
        {"start_time": 0, "page": "²"},  # str.isdigit() says yes, int() says no
        {"start_time": 0, "page": "١٢"},  # Arabic-Indic digits: int() reads them, the cursor is ASCII
        {"start_time": 0, "page": "9" * 40},
        {"start_time": YEAR_9999_DEC_30, "end_time": LAST_SECOND_OF_9999},  # a page past year 9999
        # The last bucket of 9999 ends in year 10000.
        {"start_time": YEAR_9999_DEC_30, "end_time": LAST_SECOND_OF_9999, "page": str(YEAR_9999_DEC_30 + 86400)},
        {"start_time": LAST_SECOND_OF_9999 + 1},
        {"start_time": -(10**12)},
        {"start_time": 10**30},
    ],
)
def test_unusable_values_are_400s(api: CheckedClient, team: Team, route: str, params: dict[str, object]) -> None:
    r = api.get(route, headers=team.headers, params=params)
    assert r.status_code == 400, (r.status_code, r.text)
    assert set(r.json()) == {"error"} and r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["param"] in ("page", "start_time", "end_time"), r.text


def test_the_far_but_representable_future_still_answers(api: CheckedClient, team: Team) -> None:
    year_9000 = 221845392000
    r = api.get(
        "/v1/organization/costs", headers=team.headers, params={"start_time": year_9000, "end_time": year_9000 + 86400}
    )
    assert r.status_code == 200 and len(r.json()["data"]) == 1, r.text
