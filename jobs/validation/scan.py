"""Checking every line of a batch input file and indexing the valid ones (`validate_lines`):
each line on its own (`scan_lines`), then the checks that need the whole file
(`finish_validation`). Nothing a user can write makes it raise; every problem is reported with
its line, at most `Limits.max_errors` of them listed."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from backfill.jobs.errors import BatchError, batch_error, quote
from backfill.jobs.execution.prefixes import PromptBlocks, TextBlocks
from backfill.jobs.validation.fast import line_checker
from backfill.jobs.validation.input_lines import iter_lines_bounded
from backfill.jobs.validation.lines import INT32_MAX, INT64_MAX, SeenIds, check_line
from backfill.jobs.validation.request_index import RequestIndex


@dataclass
class Limits:
    max_requests: int
    max_line_bytes: int
    max_errors: int


@dataclass
class ValidationResult:
    errors: list[BatchError] = field(default_factory=list)
    error_count: int = 0
    requests: RequestIndex = field(default_factory=RequestIndex)
    model: str | None = None
    token_estimate: int = 0

    def add_error(self, limits: Limits, *, code: str, message: str, line: int | None, param: str | None = None) -> None:
        self.error_count += 1
        if len(self.errors) < limits.max_errors:
            self.errors.append(batch_error(code, message, line=line, param=param))


@dataclass
class LineScan:
    """What one pass over a run of lines found, before the whole-file checks (`finish_validation`).
    A file is one run, or several scanned apart and merged (`scheduler.validation.pool`)."""

    result: ValidationResult
    seen_ids: SeenIds = field(default_factory=SeenIds)
    models: dict[str, int] = field(default_factory=dict)  # model -> first line naming it
    requests: int = 0  # lines that are not blank
    lines: int = 0  # the last line number the run used
    stopped: bool = False  # past max_requests: the rest was not read


def validate_lines(
    chunks: Iterable[bytes],
    *,
    endpoint: str,
    served_models: set[str] | None,
    limits: Limits,
    blocks: PromptBlocks | None = None,
) -> ValidationResult:
    """Check every line. Never raises for anything in the file; errors stay within max_errors.

    `blocks` fingerprints each prompt along its token stream (the model's tokenizer where
    backfill has it); by default a stable text approximation."""
    # One byte of slack for the '\r' of a CRLF line, which is not part of the request.
    numbered = iter_lines_bounded(chunks, max_line_bytes=min(limits.max_line_bytes, INT32_MAX - 1) + 1)
    scan = scan_lines(numbered, endpoint=endpoint, limits=limits, blocks=blocks)
    return finish_validation(scan, limits=limits, served_models=served_models)


def scan_lines(
    numbered: Iterable[tuple[int, int, int, bytes | None]],
    *,
    endpoint: str,
    limits: Limits,
    blocks: PromptBlocks | None = None,
) -> LineScan:
    """Check each line of `numbered` ((number, offset, length, raw or None past the limit), as
    `iter_lines_bounded` gives them) on its own, and index the valid ones.

    A line goes through `line_checker` first, which confirms the common valid line cheaply;
    any other goes through `check_line`, which alone reports errors."""
    blocks = blocks or TextBlocks()
    scan = LineScan(ValidationResult())
    result, index, seen_ids, models = scan.result, scan.result.requests, scan.seen_ids, scan.models
    # Line numbers, lengths and counts go into Integer columns.
    max_requests = min(limits.max_requests, INT32_MAX)
    max_line_bytes = min(limits.max_line_bytes, INT32_MAX - 1)
    count = 0
    number = 0
    token_estimate = 0
    fast = line_checker(endpoint, seen_ids)
    path_of, add = blocks.path, index.add

    def fail(code: str, message: str, param: str | None) -> None:
        result.add_error(limits, code=code, message=message, line=number, param=param)

    line: bytes | None
    for number, offset, length, raw in numbered:
        # The common line (ending in '}': not blank, no '\r' to strip; within the limit) goes on;
        # each other one the checks in order: blank, too many, '\r', too large, check_line.
        if raw and raw[-1] == 125 and len(raw) <= max_line_bytes:  # ends in '}'
            count += 1
            if count > max_requests or number > INT32_MAX:
                fail("too_many_requests", too_many_requests_message(max_requests), None)
                scan.stopped = True
                break
            line = raw
        else:
            if raw is not None and (not raw or raw.isspace()):
                continue  # blank lines are skipped, as OpenAI does
            count += 1
            if count > max_requests or number > INT32_MAX:
                fail("too_many_requests", too_many_requests_message(max_requests), None)
                scan.stopped = True
                break
            line = raw[:-1] if raw is not None and raw.endswith(b"\r") else raw
            if line is None or len(line) > max_line_bytes:
                fail("line_too_large", f"Line is {length} bytes; the limit is {max_line_bytes}.", None)
                continue
        checked = fast(line, number)
        if checked is not None:
            custom_id, model, prompt, estimate, body, output, n = checked
        else:
            request = check_line(line, endpoint=endpoint, seen_ids=seen_ids, fail=fail, number=number)
            if request is None:
                continue
            custom_id, model, prompt, estimate, body, output, n = request.values()
        if model is not None and model not in models:  # (None: the endpoint's default model)
            models[model] = number
        token_estimate += estimate
        path, prompt_tokens = path_of(endpoint, body, prompt)
        add(number, offset, length, custom_id, path, estimate, prompt_tokens + output, n)
    result.token_estimate += token_estimate
    scan.requests, scan.lines = count, number
    return scan


def too_many_requests_message(max_requests: int) -> str:
    return f"The file has more than {max_requests} requests, the most a batch may hold."


def finish_validation(scan: LineScan, *, limits: Limits, served_models: set[str] | None) -> ValidationResult:
    """The checks that need the whole file: some request at all, one model that is served, and
    how many errors went unlisted."""
    result = scan.result
    # Cannot overflow with the per-request bound, but the column is what must hold it.
    result.token_estimate = min(result.token_estimate, INT64_MAX)
    if scan.requests == 0:
        result.add_error(limits, code="empty_file", message="The input file has no requests.", line=None)
    _check_models(result, limits, scan.models, served_models)
    if result.error_count > len(result.errors):
        unlisted = result.error_count - len(result.errors)
        result.errors.append(batch_error("too_many_errors", f"{unlisted} more errors were not listed."))
    return result


def _check_models(
    result: ValidationResult, limits: Limits, models: dict[str, int], served_models: set[str] | None
) -> None:
    if len(models) > 1:
        (first, first_line), *others = sorted(models.items(), key=lambda kv: kv[1])
        for model, number in others:
            result.add_error(
                limits,
                code="mismatched_model",
                line=number,
                param="body.model",
                message=f"Model {quote(model)} differs from {quote(first)} on line {first_line}: a batch uses one model.",
            )
    if len(models) == 1:
        result.model = next(iter(models))
        if served_models is not None and result.model not in served_models:
            available = ", ".join(sorted(served_models))
            if len(available) > 150:  # the fleet's own names, but a long list is no help either
                available = available[:150] + "…"
            result.add_error(
                limits,
                code="model_not_found",
                line=models[result.model],
                param="body.model",
                message=f"The model {quote(result.model)} is not served here. Available: {available}.",
            )
