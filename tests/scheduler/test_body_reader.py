"""A drain's reads of its claimed lines: one ranged read serves the claims that follow it (read
ahead, kept per input file), and every line comes back as exactly its own bytes."""

from __future__ import annotations

import pytest

from backfill.jobs.execution.claims import ClaimedRequest
from backfill.scheduler.drain import claiming
from backfill.scheduler.drain.claiming import BodyReader


class Files:
    """An object store of a few files, counting its ranged reads."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.reads: list[tuple[str, int, int]] = []

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        self.reads.append((key, offset, length))
        return self.files[key][offset : offset + length]  # past the end: what there is


def lines_of(key: str, n: int, *, batch: str = "b", width: int = 50) -> tuple[bytes, list[ClaimedRequest]]:
    data, out, offset = b"", [], 0
    for line in range(1, n + 1):
        raw = (f'{{"custom_id":"{key}-{line}","pad":"' + "x" * (line % 7) + '"}\n').encode().ljust(width)
        out.append(ClaimedRequest(batch, line, f"{key}-{line}", offset, len(raw), 0, key, "/v1/chat/completions", 0))
        data += raw
        offset += len(raw)
    return data, out


def check(got: dict[tuple[str, int], bytes], files: Files, claimed: list[ClaimedRequest]) -> None:
    for r in claimed:
        assert got[(r.batch_id, r.line)] == files.files[r.input_key][r.offset : r.offset + r.length]


def test_claims_that_follow_one_another_are_served_by_one_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(claiming, "READ_AHEAD", 1000)  # 20 lines of 50 bytes
    data, lines = lines_of("f", 100)
    files = Files({"f": data})
    reader = BodyReader(files)  # type: ignore[arg-type]
    for group in (lines[0:3], lines[3:4], lines[4:12], lines[12:20]):  # within the first 1000 bytes
        check(reader.read(group), files, group)
    assert files.reads == [("f", 0, 1000)]
    check(reader.read(lines[18:25]), files, lines[18:25])  # beyond it: read again, from line 19
    assert files.reads[1:] == [("f", 18 * 50, 1000)]
    check(reader.read(lines[95:100]), files, lines[95:100])  # near the end: what there is
    assert len(files.reads) == 3


def test_each_input_file_keeps_its_own_window(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(claiming, "READ_AHEAD", 1000)
    a, a_lines = lines_of("a", 40, batch="ba")
    b, b_lines = lines_of("b", 40, batch="bb")
    files = Files({"a": a, "b": b})
    reader = BodyReader(files)  # type: ignore[arg-type]
    check(reader.read(a_lines[0:2] + b_lines[0:2]), files, a_lines[0:2] + b_lines[0:2])  # one group, two batches
    check(reader.read(a_lines[2:5]), files, a_lines[2:5])
    check(reader.read(b_lines[2:5]), files, b_lines[2:5])
    assert sorted(files.reads) == [("a", 0, 1000), ("b", 0, 1000)]


def test_lines_too_far_apart_are_read_each_on_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(claiming, "MAX_SPAN_READ", 400)
    monkeypatch.setattr(claiming, "READ_AHEAD", 100)
    data, lines = lines_of("f", 40)
    files = Files({"f": data})
    group = [lines[0], lines[30]]  # 1,500 bytes apart
    check(BodyReader(files).read(group), files, group)  # type: ignore[arg-type]
    assert files.reads == [("f", 0, 50), ("f", 1500, 50)]


def test_a_short_read_fails_rather_than_give_a_line_the_wrong_bytes() -> None:
    data, lines = lines_of("f", 10)
    files = Files({"f": data[:120]})  # the store has less than the index says
    with pytest.raises(OSError):
        BodyReader(files).read(lines[0:5])  # type: ignore[arg-type]
