"""The request index of a valid batch, held in memory between validation and the database:
per line its number, byte offset and length, custom_id, token estimate, and its prompt's place
in the batch's prefix tree (`jobs.prefixes`), from which the release order is derived."""

from __future__ import annotations

from array import array
from collections.abc import Collection, Iterable, Iterator
from struct import Struct
from typing import Any

from backfill.jobs.prefixes import BLOCK_TOKENS, FINGERPRINT_BYTES, PrefixPlan, node_id, plan_prefix_order
from backfill.jobs.validation_lines import INT32_MAX

# The columns a request's index row fills, in the order `RequestIndex.rows` gives them.
INDEX_COLUMNS = (
    "line",
    "custom_id",
    "offset",
    "length",
    "prefix_hash",
    "prefix_tokens",
    "kv_tokens",
    "prefix_rank",
    "after_line",
    "token_estimate",
)
_INTS = 5  # line, length, token estimate, KV tokens, completions (n): each fits an int32
_pack_ints = Struct(f"{_INTS}i").pack  # (native: as array("i") holds them)


class RequestIndex(Collection[dict[str, Any]]):
    """The index rows of a valid batch, kept in arrays: about 50 bytes a line plus its custom_id
    and prompt path (4 bytes a block) instead of a dict's 600, so a million-line batch fits a
    worker's memory. Iterating gives dicts (for tests and tools); `rows` gives the tuples the
    database writer streams.

    The release order (`jobs.prefixes.plan_prefix_order`) is derived once all lines are in.
    """

    def __init__(self, block_tokens: int = BLOCK_TOKENS) -> None:
        self.block_tokens = block_tokens
        self._ints = array("i")  # _INTS numbers a line, each within INT32_MAX (checked by validation)
        self._offsets = array("q")
        self._paths = bytearray()  # the prompt paths, one after another
        self._path_ends = array("q")
        self._ids = bytearray()  # the custom_ids in UTF-8, one after another
        self._id_ends = array("q")
        self._plan: PrefixPlan | None = None
        self._order: array[int] | None = None  # see _by_rank

    def add(
        self,
        line: int,
        offset: int,
        length: int,
        custom_id: str,
        path: bytes,
        token_estimate: int,
        kv_tokens: int,
        samples: int = 1,
    ) -> None:
        # One packed call: an array's extend converts each int with PyArg_Parse, 3x the cost.
        self._ints.frombytes(_pack_ints(line, length, token_estimate, min(kv_tokens, INT32_MAX), samples))
        self._offsets.append(offset)
        paths = self._paths
        if path:  # (most short prompts have none)
            paths += path
        self._path_ends.append(len(paths))
        ids = self._ids
        ids += custom_id.encode()
        self._id_ends.append(len(ids))
        self._plan = None

    def __len__(self) -> int:
        return len(self._id_ends)

    def extend(self, other: RequestIndex, *, line_base: int) -> None:
        """Append another index's lines, their numbers shifted by `line_base` (the lines before
        the other's part of the file)."""
        ints = array("i", other._ints)
        if line_base:
            ints[0::_INTS] = array("i", [n + line_base for n in ints[0::_INTS]])
        self._ints.extend(ints)
        self._offsets.extend(other._offsets)
        shift = len(self._paths)
        self._paths += other._paths
        self._path_ends.extend(end + shift for end in other._path_ends)
        shift = len(self._ids)
        self._ids += other._ids
        self._id_ends.extend(end + shift for end in other._id_ends)
        self._plan = None

    def _path(self, i: int) -> bytes:
        return bytes(self._paths[self._path_ends[i - 1] if i else 0 : self._path_ends[i]])

    def plan(self) -> PrefixPlan:
        if self._plan is None:
            paths = [self._path(i) for i in range(len(self))]
            self._plan = plan_prefix_order(paths, self._ints[0::_INTS], self._ints[3::_INTS])
        return self._plan

    def rows(self, ranks: range | None = None) -> Iterator[tuple[Any, ...]]:
        """Each line's index row: the values of INDEX_COLUMNS, in order. All lines in input
        order, or with `ranks` the lines at those places of the release order, in that order."""
        ints, offsets, bt = self._ints, self._offsets, self.block_tokens
        ids, id_ends = self._ids, self._id_ends
        plan = self.plan()
        shared_blocks, session_kv, rank, after = plan.shared_blocks, plan.session_kv, plan.rank, plan.after
        no_blocks = node_id(b"", 0)  # a prompt shorter than one block: the common short line
        if ranks is None:
            lines: Iterable[int] = range(len(self))
        else:
            by_rank = self._by_rank()
            lines = (by_rank[r] for r in ranks)
        for i in lines:
            k = _INTS * i
            custom_id = ids[id_ends[i - 1] if i else 0 : id_ends[i]].decode()
            path, shared = self._path(i), shared_blocks[i]
            blocks = len(path) // FINGERPRINT_BYTES
            if ints[k + 4] > 1:  # n completions share their whole prompt
                shared = max(shared, blocks)
            prefix_tokens = min(shared * bt, INT32_MAX)
            yield (
                ints[k],
                custom_id,
                offsets[i],
                ints[k + 1],
                # The node shared with other lines; a line sharing nothing is its own group.
                node_id(path, shared or blocks) if path else no_blocks,
                prefix_tokens,
                max(session_kv[i], prefix_tokens),
                rank[i],
                after[i] or None,
                ints[k + 2],
            )

    def _by_rank(self) -> array[int]:
        """The lines (their places in this index) in release order: the inverse of the rank."""
        if self._order is None or len(self._order) != len(self):
            rank = self.plan().rank
            order = array("q", bytes(8 * len(self)))
            for i, r in enumerate(rank):
                order[r] = i
            self._order = order
        return self._order

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for row in self.rows():
            yield dict(zip(INDEX_COLUMNS, row, strict=True))

    def __contains__(self, item: object) -> bool:
        return any(row == item for row in self)
