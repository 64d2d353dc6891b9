"""Throughput of `validate_lines` on a generated file, fed in the object store's 1 MiB chunks,
for the working tree's validation next to a git revision's: same run, same data, interleaved,
`--repeat` times each, reported as the median with the spread (min-max) over the runs, since a
shared machine's neighbours move single runs a lot.

Line shapes (`--line-shape`):
- `chat600`: ~600-byte chat lines, a system and a user message, max_tokens and temperature;
- `scale200`: bench/scale.py's own lines (`write_input`): one user message, ~200 bytes;
- `all`: both, one after the other.

"Before" is the revision's jobs/validation/outcome.py with that revision's modules of validation
(REVISION_MODULES: reading lines, the per-line checks and their fast path, the prompt
fingerprints, the request index and the scan; those a revision lacks are skipped); the rest of
`jobs` is the working tree's.

    .venv/bin/python -m bench.validate_speed                          # 50 MB of chat600, against HEAD
    .venv/bin/python -m bench.validate_speed --line-shape all --repeat 7
    .venv/bin/python -m bench.validate_speed --mb 200 --before HEAD~3 --line-shape scale200
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
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
SHAPES = ("chat600", "scale200")
# The modules a revision's validation is made of, in import order: (module, path, its import name).
REVISION_MODULES = tuple(
    (name, f"jobs/{name}.py", f"jobs.{name}")
    for name in (
        "input_lines",
        "validation_lines",
        "validation_fast",
        "prefixes",
        "request_index",
        "validation_scan",
        "validation",
    )
)


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


def make_scale_file(target_bytes: int) -> bytes:
    """bench/scale.py's input: 200-byte lines of one user message each, as many as fill the size."""
    sys.path.insert(0, str(ROOT))
    from bench.scale import write_input

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "input.jsonl"
        write_input(path, max(1, target_bytes // 200), 200)
        return path.read_bytes()


def load_revision(rev: str) -> ModuleType:
    """The revision's validation module, importing that revision's line checks and prefixes (each
    loaded under a name of its own, so the working tree's stay as they are)."""
    tmp = Path(tempfile.mkdtemp())
    loaded: dict[str, str] = {}  # import name -> the name it is loaded under
    module: ModuleType | None = None
    for name, path, import_name in REVISION_MODULES:
        shown = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True)
        if shown.returncode:  # not in that revision: its validation used none
            continue
        source = shown.stdout.decode()
        for original, alias in loaded.items():  # imported as jobs.x, or (since) as backfill.jobs.x
            source = source.replace(f"from backfill.{original} import", f"from {alias} import")
            source = source.replace(f"from {original} import", f"from {alias} import")
        alias = f"{name}_before"
        file = tmp / f"{alias}.py"
        file.write_text(source)
        spec = importlib.util.spec_from_file_location(alias, file)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while decorating
        spec.loader.exec_module(module)
        loaded[import_name] = alias
    assert module is not None and module.__name__ == "validation_before", rev
    return module


def run_once(module: Any, data: bytes, lines: int) -> tuple[float, float, int]:
    """(wall seconds, this process's CPU seconds, lines indexed) of one validation."""
    chunks = [data[i : i + CHUNK] for i in range(0, len(data), CHUNK)]
    limits = module.Limits(max_requests=lines, max_line_bytes=1 << 20, max_errors=100)
    start, cpu = time.perf_counter(), time.process_time()
    result = module.validate_lines(
        iter(chunks), endpoint="/v1/chat/completions", served_models={"tiny-chat"}, limits=limits
    )
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    assert not result.errors, result.errors[:3]
    return elapsed, cpu, len(result.requests)


def same_index(before: Any, after: Any, data: bytes, lines: int) -> bool:
    """Whether both give the same index rows (and estimate) for the file."""
    chunks = [data[i : i + CHUNK] for i in range(0, len(data), CHUNK)]
    results = []
    for module in (before, after):
        limits = module.Limits(max_requests=lines, max_line_bytes=1 << 20, max_errors=100)
        result = module.validate_lines(
            iter(chunks), endpoint="/v1/chat/completions", served_models={"tiny-chat"}, limits=limits
        )
        results.append((list(result.requests.rows()), result.token_estimate, result.model))
    return results[0] == results[1]


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


def measure(shape: str, data: bytes, modules: dict[str, Any], args: argparse.Namespace) -> None:
    lines = data.count(b"\n")
    mb = len(data) / 1_000_000
    times: dict[str, list[float]] = {name: [] for name in modules}
    cpu_times: dict[str, list[float]] = {name: [] for name in modules}
    for _ in range(args.repeat):
        for name, module in modules.items():
            elapsed, cpu, n = run_once(module, data, lines)
            assert n == lines, (name, n, lines)
            times[name].append(elapsed)
            cpu_times[name].append(cpu)
    print(f"{shape}: {mb:.1f} MB, {lines} lines of ~{len(data) // lines} bytes, {args.repeat} runs each")
    medians: dict[str, float] = {}
    for name, label in (("before", args.before), ("after", "working tree")):
        for kind, ts in (("wall", times[name]), ("cpu", cpu_times[name])):
            med = statistics.median(ts)
            if kind == "wall":
                medians[name] = med
            print(
                f"  {name:>6} ({label}) {kind:>4}: median {med:.2f} s = {mb / med:.1f} MB/s,"
                f" {med / lines * 1e6:.2f} us/line (runs {min(ts):.2f}-{max(ts):.2f} s ="
                f" {mb / max(ts):.1f}-{mb / min(ts):.1f} MB/s)"
            )
    cpu_speedup = statistics.median(cpu_times["before"]) / statistics.median(cpu_times["after"])
    print(f"  speedup (medians): wall {medians['before'] / medians['after']:.2f}x, cpu {cpu_speedup:.2f}x")
    if not args.no_memory:
        peak = {name: peak_memory(module, data, lines) for name, module in modules.items()}
        print(f"  peak traced memory (chunks excluded): before {peak['before']:.0f} MB, after {peak['after']:.0f} MB")
    if not args.no_check:
        print(f"  same index rows before and after: {same_index(modules['before'], modules['after'], data, lines)}")
    print(
        f"validate[{shape}]: before_mb_s={mb / medians['before']:.1f} after_mb_s={mb / medians['after']:.1f}"
        f" before_us_line={medians['before'] / lines * 1e6:.2f} after_us_line={medians['after'] / lines * 1e6:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=50.0)
    parser.add_argument("--before", default="HEAD", help="git revision of jobs/validation*.py, prefixes.py")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--line-shape", choices=(*SHAPES, "all"), default="chat600")
    parser.add_argument("--no-memory", action="store_true", help="skip the traced-memory runs")
    parser.add_argument("--no-check", action="store_true", help="skip comparing the index rows")
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT))
    from backfill.jobs.validation import scan as after

    modules = {"before": load_revision(args.before), "after": after}
    for shape in SHAPES if args.line_shape == "all" else (args.line_shape,):
        target = int(args.mb * 1_000_000)
        data = make_file(target) if shape == "chat600" else make_scale_file(target)
        measure(shape, data, modules, args)


if __name__ == "__main__":
    main()
