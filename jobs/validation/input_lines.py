"""Reading a JSONL file a line at a time, with each line's number, byte offset and length.

Bounded by a line, never by the user: a line longer than the limit is counted and skipped in
bounded memory, so a 1 GB line costs no more than the limit.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator


def iter_lines(chunks: Iterable[bytes]) -> Iterator[tuple[int, int, bytes]]:
    """Yield (1-based line number, byte offset, raw line without the newline), however long.

    For files the service wrote itself or a user's own local file; what a user uploaded is
    read with iter_lines_bounded.
    """
    for number, offset, _, raw in iter_lines_bounded(chunks, max_line_bytes=sys.maxsize):
        if raw is not None:  # always, without a limit
            yield number, offset, raw


def iter_lines_bounded(chunks: Iterable[bytes], *, max_line_bytes: int) -> Iterator[tuple[int, int, int, bytes | None]]:
    """Yield (1-based line number, byte offset, length, raw line without its newline).

    A line longer than max_line_bytes comes as (number, offset, length, None): past the limit
    its bytes are counted and dropped, so a 1 GB line costs no more memory than the limit.
    """
    limit = max_line_bytes
    parts: list[bytes] = []  # the pieces of a line that spans chunks, while within the limit
    held = 0  # bytes of that line seen so far; 0 when no line is open
    skipping = False
    offset = 0  # where the open line starts
    pos = 0  # where the current chunk starts
    number = 0
    for chunk in chunks:
        start = 0
        find = chunk.find
        while (nl := find(b"\n", start)) >= 0:
            number += 1
            if not held:  # the common case: the whole line lies in this chunk
                length = nl - start
                yield number, pos + start, length, chunk[start:nl] if length <= limit else None
            else:
                length = held + nl - start
                if skipping or length > limit:
                    yield number, offset, length, None
                else:
                    parts.append(chunk[start:nl])
                    yield number, offset, length, b"".join(parts)
                parts = []
                held = 0
                skipping = False
            start = nl + 1
        rest = len(chunk) - start
        if rest:
            if not held:
                offset = pos + start
            held += rest
            if held > limit:
                skipping = True
                parts = []
            elif not skipping:
                parts.append(chunk[start:] if start else chunk)
        pos += len(chunk)
    if held:
        yield number + 1, offset, held, None if skipping else b"".join(parts)
