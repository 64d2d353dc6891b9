"""Writing a batch's request index: the release order placed at each line's shared node, in file
order there (`jobs.execution.prefixes._release_order`), next to the order it replaced (the full prompt
paths sorted, which scatters the lines under one preamble), in one run on one file.

An eval sweep (one long preamble, then a question per line, each filling blocks of its own) is
validated once; its index rows are then COPYed into a scratch Postgres database once with each
order, alternating, `--repeat` times. The rows are the same except `prefix_rank`.

    .venv/bin/python -m bench.index_order                  # 300,000 lines
    .venv/bin/python -m bench.index_order --lines 1000000 --repeat 2
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import tempfile
import time
from array import array
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import psycopg

from backfill.jobs.validation.request_index import RequestIndex, copy_text, row_columns
from backfill.jobs.validation.scan import Limits, validate_lines

PG_ADMIN_URL = os.environ.get("TEST_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
CHAT = "/v1/chat/completions"


def write_sweep(path: Path, lines: int) -> None:
    preamble = "You are grading answers. Read the rubric carefully and apply it to each answer. " * 4
    with path.open("w") as f:
        for i in range(lines):
            question = f"Question {i * 7919 % lines}: what is {i} times {i}? Explain each step in detail. " * 4
            body = {
                "model": "m",
                "max_tokens": 2,
                "messages": [{"role": "system", "content": preamble}, {"role": "user", "content": question}],
            }
            f.write(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": CHAT, "body": body}) + "\n")


def chunks(path: Path) -> Iterator[bytes]:
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            yield block


def path_sorted_ranks(index: RequestIndex) -> array[int]:
    """The order before: every line by its whole path, ties by line."""
    paths = [index._path(i) for i in range(len(index))]
    rank = array("q", bytes(8 * len(paths)))
    for pos, i in enumerate(sorted(range(len(paths)), key=paths.__getitem__)):
        rank[i] = pos
    return rank


def copy_rows(url: str, rows: list[tuple[object, ...]]) -> float:
    names, constants = row_columns()
    text = list(copy_text("b" * 24, rows, constants))
    statement = "COPY batch_requests ({}) FROM STDIN".format(", ".join(f'"{n}"' for n in names))
    with psycopg.connect(url) as conn:
        conn.execute("TRUNCATE batch_requests")
        conn.commit()
        conn.execute("CHECKPOINT")
        start = time.perf_counter()
        with conn.cursor() as cursor, cursor.copy(statement) as copy:
            for chunk in text:
                copy.write(chunk)
        conn.commit()
        return time.perf_counter() - start


def descents(rows: list[tuple[object, ...]]) -> int:
    ranks = [int(r[7]) for r in rows]  # type: ignore[call-overload]
    return sum(1 for a, b in pairwise(ranks) if b < a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, default=300_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    from backfill.devfleet.services import create_database, drop_database

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "sweep.jsonl"
        write_sweep(path, args.lines)
        limits = Limits(max_requests=args.lines, max_line_bytes=1 << 20, max_errors=100)
        result = validate_lines(chunks(path), endpoint=CHAT, served_models=None, limits=limits)
    assert not result.errors, result.errors[:3]
    index = result.requests
    start = time.perf_counter()
    index.plan()
    plan_s = time.perf_counter() - start
    now = list(index.rows())
    old_rank = path_sorted_ranks(index)
    before = [(*r[:7], old_rank[i], *r[8:]) for i, r in enumerate(now)]
    print(
        f"{args.lines} lines; plan {plan_s:.2f} s; rank descents in file order: before {descents(before)}, now {descents(now)}"
    )

    db = f"backfill_index_order_{secrets.token_hex(4)}"
    url = create_database(PG_ADMIN_URL, db).replace("postgresql+psycopg://", "postgresql://")
    times: dict[str, list[float]] = {"before": [], "now": []}
    try:
        for _ in range(args.repeat):
            for name, rows in (("before", before), ("now", now)):
                times[name].append(copy_rows(url, rows))
                print(f"  COPY {name:<6} {times[name][-1]:.2f} s", flush=True)
    finally:
        drop_database(PG_ADMIN_URL, db)
    b, n = statistics.median(times["before"]), statistics.median(times["now"])
    spread = {k: f"{min(v):.2f}-{max(v):.2f}" for k, v in times.items()}
    print(f"COPY median: before {b:.2f} s ({spread['before']}), now {n:.2f} s ({spread['now']})")
    print(f"index_order: lines={args.lines} copy_before_s={b:.2f} copy_now_s={n:.2f} speedup={b / n:.2f}")


if __name__ == "__main__":
    main()
