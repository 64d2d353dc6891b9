"""The two-model harvest's figures per model: each model's interactive requests against its own
SLO rule, each model's batch tokens over the trace."""

from __future__ import annotations

import math

from bench.harvest_models import summarize, table
from bench.harvest_results import SloRule


def request(ttft: float, itl: float) -> dict[str, object]:
    return {"status": 200, "ttft": ttft, "itl": itl}


def test_figures_per_model() -> None:
    raw = {
        "t0": 100.0,
        "t_end": 150.0,
        "interactive": {"busy": [request(0.1, 0.01), request(0.3, 0.01), request(0.1, 0.05), request(0.1, 0.01)]},
        "batch": {"busy": (5000, 20, 1), "idle": (40000, 120, 0)},
    }
    busy = summarize("c", raw, "busy", SloRule(ttft_s=0.2, itl_s=0.02))
    idle = summarize("c", raw, "idle", None)
    assert (busy.attainment, busy.n, busy.batch_tok_s, busy.batch_failed) == (50.0, 4, 100.0, 1)
    assert idle.n == 0 and math.isnan(idle.attainment) and idle.batch_tok_s == 800.0
    rows = table([busy, idle]).splitlines()
    assert rows[2] == "| c | busy | 50.0% of 4 | 100 | 20 |"
    assert rows[3] == "| c | idle | no interactive load | 800 | 120 |"
