"""Throughput of `validate_lines` on a generated file of ~600-byte chat lines, fed in the object
store's 1 MiB chunks, for the working tree's validation next to a git revision's (same run, same
data, interleaved, best of `--repeat`).

    .venv/bin/python -m bench.validate_speed                 # 50 MB, against HEAD
    .venv/bin/python -m bench.validate_speed --mb 200 --before HEAD~3
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from types import ModuleType
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parent.parent
CHUNK = 1024 * 1024


def make_file(target_bytes: int) -> bytes:
    system = "You are a careful assistant that answers questions about the attached document. " * 2
    lines = []
    size = 0
    i = 0
    while size < target_bytes:
        line = orjson.dumps(
            {
                "custom_id": f"request-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "tiny-chat",
                    "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": f"Question {i}: " + "what does the document say? " * 8},
                    ],
                    "max_tokens": 256,
                    "temperature": 0.7,
                },
            }
        )
        lines.append(line)
        size += len(line) + 1
        i += 1
    return b"\n".join(lines) + b"\n"


def load_revision(rev: str) -> ModuleType:
    source = subprocess.run(
        ["git", "show", f"{rev}:jobs/validation.py"], cwd=ROOT, check=True, capture_output=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "validation_before.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location("validation_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while decorating
    spec.loader.exec_module(module)
    return module


def run_once(module: Any, data: bytes, lines: int) -> tuple[float, int]:
    chunks = [data[i : i + CHUNK] for i in range(0, len(data), CHUNK)]
    limits = module.Limits(max_requests=lines, max_line_bytes=1 << 20, max_errors=100)
    start = time.perf_counter()
    result = module.validate_lines(
        iter(chunks), endpoint="/v1/chat/completions", served_models={"tiny-chat"}, limits=limits
    )
    elapsed = time.perf_counter() - start
    assert not result.errors, result.errors[:3]
    return elapsed, len(result.requests)


def peak_memory(module: Any, data: bytes, lines: int) -> float:
    chunks = [data[i : i + CHUNK] for i in range(0, len(data), CHUNK)]
    tracemalloc.start()
    try:
        limits = module.Limits(max_requests=lines, max_line_bytes=1 << 20, max_errors=100)
        result = module.validate_lines(
            iter(chunks), endpoint="/v1/chat/completions", served_models={"tiny-chat"}, limits=limits
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    del result
    return peak / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=50.0)
    parser.add_argument("--before", default="HEAD", help="git revision of jobs/validation.py to compare with")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT))
    from jobs import validation as after

    before = load_revision(args.before)
    data = make_file(int(args.mb * 1_000_000))
    lines = data.count(b"\n")
    mb = len(data) / 1_000_000
    best = {"before": float("inf"), "after": float("inf")}
    for _ in range(args.repeat):
        for name, module in (("before", before), ("after", after)):
            elapsed, n = run_once(module, data, lines)
            assert n == lines, (name, n, lines)
            best[name] = min(best[name], elapsed)
    print(f"file: {mb:.1f} MB, {lines} lines of ~{len(data) // lines} bytes")
    for name in ("before", "after"):
        print(
            f"{name:>6} ({args.before if name == 'before' else 'working tree'}): "
            f"{best[name]:.2f} s, {mb / best[name]:.1f} MB/s"
        )
    peak = {name: peak_memory(module, data, lines) for name, module in (("before", before), ("after", after))}
    print(
        f"peak traced memory while validating (chunks excluded): before {peak['before']:.0f} MB, "
        f"after {peak['after']:.0f} MB"
    )
    print(f"validate: before_mb_s={mb / best['before']:.1f} after_mb_s={mb / best['after']:.1f}")


if __name__ == "__main__":
    main()
