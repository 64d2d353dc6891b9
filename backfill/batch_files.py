"""File transfers of the batch CLI: results streamed to disk, the lines a retry resubmits.

Every transfer streams (`files.with_streaming_response.content`), so a batch's files never have
to fit in memory: only the custom_ids of the lines to retry are held.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING

import orjson

from backfill.jobs.validation.input_lines import iter_lines

if TYPE_CHECKING:
    import openai

CHUNK_BYTES = 1 << 20
# Error lines of these codes are not retried: the user cancelled those requests.
NOT_RETRIED_CODES = frozenset({"batch_cancelled"})


def download(client: openai.OpenAI, file_id: str, path: Path) -> int:
    """Stream a file to `path` (through a `.part` file, so a broken transfer leaves no half
    file under the final name) and return its number of lines."""
    part = path.with_name(path.name + ".part")
    lines = 0
    last = b"\n"
    with client.files.with_streaming_response.content(file_id) as response, part.open("wb") as out:
        for chunk in response.iter_bytes(CHUNK_BYTES):
            if chunk:
                out.write(chunk)
                lines += chunk.count(b"\n")
                last = chunk[-1:]
    if last != b"\n":
        lines += 1  # a last line without its newline
    part.replace(path)
    return lines


def _file_lines(client: openai.OpenAI, file_id: str) -> Iterator[bytes]:
    with client.files.with_streaming_response.content(file_id) as response:
        for _, _, raw in iter_lines(response.iter_bytes(CHUNK_BYTES)):
            line = raw.rstrip(b"\r")
            if line.strip():
                yield line


def retryable_custom_ids(client: openai.OpenAI, error_file_id: str) -> set[str]:
    """custom_ids of the error file's failed lines (the fleet's 4xx/5xx, retries exhausted) and
    expired ones (`batch_expired`)."""
    ids: set[str] = set()
    for line in _file_lines(client, error_file_id):
        record = orjson.loads(line)
        error = record.get("error")
        if isinstance(error, dict) and error.get("code") in NOT_RETRIED_CODES:
            continue
        ids.add(record["custom_id"])
    return ids


def copy_lines(client: openai.OpenAI, input_file_id: str, custom_ids: set[str], out: IO[bytes]) -> set[str]:
    """Write the input file's lines whose custom_id is in `custom_ids` to `out`, byte for byte
    and in input order; return the custom_ids found."""
    found: set[str] = set()
    for line in _file_lines(client, input_file_id):
        try:
            custom_id = orjson.loads(line).get("custom_id")
        except (orjson.JSONDecodeError, AttributeError):
            continue  # the batch validated, so this cannot be one of its requests
        if custom_id in custom_ids and custom_id not in found:
            found.add(custom_id)
            out.write(line + b"\n")
    return found
