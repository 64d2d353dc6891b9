"""Validation of a large input file on several processes.

Checking a line is Python work (about 6 us a line), so one process validates a million-line
file in seconds while the machine's other cores idle. A file past PARALLEL_MIN_BYTES is cut
into byte ranges; a process per range reads its range from the object store itself and scans
the lines that start in it (`jobs.validation.scan.scan_lines`); the scans are merged in file order:
line numbers shifted by the lines before each range, custom_ids checked across ranges, the
request indexes joined. The whole-file checks then run once (`finish_validation`), so the
result is the one a single pass gives.

Each other range goes to a fresh interpreter running this module (see `_start_scanner`); this
process scans the first range meanwhile.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import time
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain

from backfill.jobs.errors import BatchError, batch_error
from backfill.jobs.validation.input_lines import iter_lines_bounded
from backfill.jobs.validation.lines import INT32_MAX, SeenIds, duplicate_id_message
from backfill.jobs.validation.scan import (
    Limits,
    LineScan,
    ValidationResult,
    finish_validation,
    scan_lines,
    too_many_requests_message,
    validate_lines,
)
from backfill.storage.objects import ObjectStore

log = logging.getLogger("backfill.validation")

PARALLEL_MIN_BYTES = 32 << 20  # below this, starting processes costs more than it saves
MAX_PROCESSES = 8

StoreFactory = Callable[[], ObjectStore]


def default_processes() -> int:
    return max(1, min(MAX_PROCESSES, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1))


def validate_object(
    open_store: StoreFactory,
    key: str,
    size: int,
    *,
    endpoint: str,
    served_models: set[str] | None,
    limits: Limits,
    processes: int,
) -> ValidationResult:
    """Validate the object at `key` (`size` bytes) with up to `processes` processes.

    `open_store` must be picklable (a module-level function or a partial of a class): each
    process opens its own store, since a client's connections do not survive a fork."""
    processes = min(processes, size // (PARALLEL_MIN_BYTES // 2) or 1)
    if processes < 2 or size < PARALLEL_MIN_BYTES:
        return validate_lines(open_store().open(key), endpoint=endpoint, served_models=served_models, limits=limits)
    started = time.monotonic()
    bounds = [size * i // processes for i in range(processes + 1)]
    scanners = [
        _start_scanner((open_store, key, bounds[i], bounds[i + 1], endpoint, limits)) for i in range(1, processes)
    ]
    try:
        # This process scans the first range while the others scan the rest.
        first = scan_range(open_store, key, bounds[0], bounds[1], endpoint, limits)
        rest = [_collect(scanner) for scanner in scanners]
    except ScannerFailed:  # killed (memory?), or could not start: one pass here still gives the answer
        log.warning("validation of %s: a scanning process failed; validating in one process", key, exc_info=True)
        return validate_lines(open_store().open(key), endpoint=endpoint, served_models=served_models, limits=limits)
    finally:
        for scanner in scanners:
            if scanner.poll() is None:
                scanner.kill()
                scanner.wait()
    result = finish_validation(merge_scans(first, rest, limits), limits=limits, served_models=served_models)
    log.info(
        "validated %s: %.1f MB, %d requests, %d errors, in %.1f s on %d processes",
        key,
        size / 1e6,
        len(result.requests),
        result.error_count,
        time.monotonic() - started,
        processes,
    )
    return result


class ScannerFailed(Exception):
    pass


def _start_scanner(args: tuple[object, ...]) -> subprocess.Popen[bytes]:
    """A scanner is a fresh interpreter (`python -m scheduler.validation.pool`) given its range as
    a pickle on stdin: not a multiprocessing child, which Celery's daemonic pool processes may
    not have, nor a fork of a worker that may hold other threads' locks."""
    proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin is not None
    try:
        proc.stdin.write(pickle.dumps(args))
        proc.stdin.close()
    except BrokenPipeError:
        pass  # it died at once: _collect says so
    return proc


def _collect(proc: subprocess.Popen[bytes]) -> PackedScan:
    assert proc.stdout is not None
    data = proc.stdout.read()
    code = proc.wait()
    if code != 0 or not data:
        raise ScannerFailed(f"scanner exited with {code}")
    scan = pickle.loads(data)
    assert isinstance(scan, PackedScan)
    return scan


@dataclass
class PackedScan:
    """A scan as it travels between processes: its custom_ids as one string (NUL is refused in
    them, so it separates them) and their lines as an array, which pickle as two buffers
    where a dict of half a million ids pickles and unpickles entry by entry."""

    scan: LineScan
    ids: str
    id_lines: array[int]


def packed_scan_range(
    open_store: StoreFactory, key: str, start: int, end: int, endpoint: str, limits: Limits
) -> PackedScan:
    scan = scan_range(open_store, key, start, end, endpoint, limits)
    packed = PackedScan(scan, "\0".join(scan.seen_ids.ids), scan.seen_ids.lines)
    scan.seen_ids = SeenIds()
    return packed


def scan_range(open_store: StoreFactory, key: str, start: int, end: int, endpoint: str, limits: Limits) -> LineScan:
    """Scan the lines that start in [start, end), numbered from 1 within the range."""
    store = open_store()
    begin = max(0, start - 1)  # from the byte before: a line starts at `start` if that byte ends one
    chunks = store.open(key, start=begin)
    max_line_bytes = min(limits.max_line_bytes, INT32_MAX - 1) + 1  # as validate_lines: '\r' slack
    return scan_lines(
        lines_starting_in(chunks, begin=begin, skip_first=start > 0, end=end, max_line_bytes=max_line_bytes),
        endpoint=endpoint,
        limits=limits,
    )


def lines_starting_in(
    chunks: Iterable[bytes], *, begin: int, skip_first: bool, end: int, max_line_bytes: int
) -> Iterator[tuple[int, int, int, bytes | None]]:
    """`iter_lines_bounded` over a stream read from byte `begin`, with file offsets, for the lines
    that start before `end`; with `skip_first`, from the first line start after `begin`."""
    stream = iter(chunks)
    base = begin
    if skip_first:
        for chunk in stream:
            newline = chunk.find(b"\n")
            if newline >= 0:
                base += newline + 1
                stream = chain([chunk[newline + 1 :]], stream)
                break
            base += len(chunk)  # (inside a long line that started before the range: dropped)
        else:
            return
    for number, offset, length, raw in iter_lines_bounded(stream, max_line_bytes=max_line_bytes):
        if base + offset >= end:
            return
        yield number, base + offset, length, raw


def merge_scans(first: LineScan, rest: Sequence[PackedScan], limits: Limits) -> LineScan:
    """The scans of consecutive ranges (the first scanned here, the rest packed by other
    processes) as the scan of the whole file would be."""
    merged = first
    result = merged.result
    seen = merged.seen_ids
    errors = list(result.errors)
    lines = merged.lines
    for k, packed in enumerate(rest, start=1):
        scan, ids, id_lines = packed.scan, packed.ids.split("\0") if packed.ids else [], packed.id_lines
        part = scan.result
        errors += [_shifted(e, lines) for e in part.errors]
        result.error_count += part.error_count
        result.token_estimate += part.token_estimate
        for model, line in scan.models.items():
            merged.models.setdefault(model, line + lines)
        # Ids met in an earlier range, reported at their later line, as one pass would.
        repeated = [
            (line + lines, custom_id) for custom_id, line in zip(ids, id_lines, strict=True) if custom_id in seen
        ]
        errors += [_duplicate(custom_id, line) for line, custom_id in repeated[: limits.max_errors]]
        result.error_count += len(repeated)
        if k < len(rest):  # a later range still checks against these
            for custom_id, line in zip(ids, id_lines, strict=True):
                if custom_id not in seen:
                    seen.add(custom_id, line + lines)
        del ids
        result.requests.extend(part.requests, line_base=lines)
        merged.requests += scan.requests
        merged.stopped = merged.stopped or scan.stopped
        lines += scan.lines
    merged.lines = lines
    merged.seen_ids = SeenIds()
    max_requests = min(limits.max_requests, INT32_MAX)
    if not merged.stopped and (merged.requests > max_requests or lines > INT32_MAX):
        result.error_count += 1
        errors.append(batch_error("too_many_requests", too_many_requests_message(max_requests)))
    errors.sort(key=lambda e: (e["line"] is None, e["line"] or 0))
    result.errors = errors[: limits.max_errors]
    return merged


def _duplicate(custom_id: str, line: int) -> BatchError:
    return batch_error("duplicate_custom_id", duplicate_id_message(custom_id), line=line, param="custom_id")


def _shifted(error: BatchError, lines: int) -> BatchError:
    """An error of a later range, its line numbered in the whole file (`lines` before the range)."""
    line = error["line"]
    return error if line is None else {**error, "line": line + lines}


if __name__ == "__main__":  # a scanner: see _start_scanner
    # Through the module's own name, so what is pickled names `scheduler.validation.pool`, not `__main__`.
    from backfill.scheduler.validation.pool import packed_scan_range

    scan = packed_scan_range(*pickle.load(sys.stdin.buffer))
    sys.stdout.buffer.write(pickle.dumps(scan, protocol=5))
