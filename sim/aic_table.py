"""Step-time tables for the GB200 GLM-5.3 NVFP4 fleet, from NVIDIA's aiconfigurator-core.

aiconfigurator-core (PyPI, Apache-2.0) estimates a vLLM engine's prefill and decode latencies
from operator measurements taken on the target GPUs (here GB200, vLLM 0.24.0), for a named model
configuration (`nvidia/GLM-5.3-NVFP4`). The simulator does not need the package at run time:
this module asks it once for a grid of latencies and writes them as JSON next to the fleet
files, and `backfill.sim.perf.TablePerf` interpolates that grid.

    .venv/bin/pip install aiconfigurator-core   # (+ numpy, pandas, pyarrow, scipy)
    .venv/bin/python -m backfill.sim.aic_table  # rewrites sim/fleets/gb200-glm53-nvfp4-perf.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OUT = HERE / "fleets" / "gb200-glm53-nvfp4-perf.json"

NEW_TOKENS = [16, 64, 256, 1024, 2048, 4096, 8192, 16384]
PREFIX = [0, 4096, 16384, 65536, 131072]
BATCH = [1, 2, 4, 8, 16, 32, 64, 128, 256]
CONTEXT = [1024, 4096, 16384, 65536, 131072]


def build(model: str, system: str, backend: str, version: str, parallel: dict[str, int], nextn: int) -> dict[str, Any]:
    from aiconfigurator_core.sdk.engine import EngineHandle

    h = EngineHandle.compile(model, system, backend, backend_version=version, nextn=nextn, **parallel)
    prefill = [[h.predict_prefill_latency(1, n + p, p) for p in PREFIX] for n in NEW_TOKENS]
    decode = [[h.predict_decode_latency(b, c, 2) for c in CONTEXT] for b in BATCH]
    return {
        "source": f"aiconfigurator-core {_version()} EngineHandle.compile({model!r}, {system!r}, {backend!r}, "
        f"backend_version={version!r}, nextn={nextn}, {parallel})",
        "units": "ms",
        "new_tokens": NEW_TOKENS,
        "prefix": PREFIX,
        "prefill_ms": prefill,
        "batch": BATCH,
        "context": CONTEXT,
        "decode_ms": decode,
    }


def _version() -> str:
    from importlib.metadata import version

    return version("aiconfigurator-core")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="nvidia/GLM-5.3-NVFP4")
    p.add_argument("--system", default="gb200")
    p.add_argument("--backend", default="vllm")
    p.add_argument("--version", default="0.24.0")
    p.add_argument("--tp", type=int, default=4, help="GPUs per engine (one GB200 tray: 4)")
    p.add_argument("--ep", type=int, default=4)
    p.add_argument("--nextn", type=int, default=0, help="MTP draft tokens")
    p.add_argument("--out", default=str(OUT))
    a = p.parse_args(argv)
    table = build(a.model, a.system, a.backend, a.version, {"tp_size": a.tp, "moe_ep_size": a.ep}, a.nextn)
    Path(a.out).write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
