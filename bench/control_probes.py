"""What bench.control reads around a batch: Postgres WAL, rows and sizes, Redis commands, and S3
requests counted by a pass-through proxy in front of the object store.

Each probe takes a snapshot before and after; the difference is what the batch cost. The
database and the Redis are the benchmark's own (a private cluster and redis-server), so no other
work on the machine shows up in their counters.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from dataclasses import dataclass

import psycopg
import redis

from backfill.devfleet.processes import LOOPBACK
from backfill.devfleet.s3 import SeaweedS3

# A request line. An HTTP body never holds " HTTP/1.1\r\n" after a method and a path in what
# backfill sends S3 (JSONL and result files), so counting these counts requests.
REQUEST_LINE = re.compile(rb"(?:GET|PUT|POST|HEAD|DELETE|PATCH) /\S* HTTP/1\.[01]\r\n")
TAIL = 64  # bytes kept across reads: a request line split by a read boundary still matches once


class CountingProxy:
    """A TCP pass-through to `upstream_port` that counts the HTTP requests going through it, per
    method. Bytes go through untouched (S3's SigV4 signs the Host header, which a rewriting proxy
    would break)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self.counts: dict[str, int] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="s3-counter", daemon=True)

    def start(self) -> CountingProxy:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("counting proxy did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        server = loop.run_until_complete(asyncio.start_server(self._handle, LOOPBACK, 0, backlog=512))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            server.close()
            loop.close()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(LOOPBACK, self.upstream_port)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(self._pump(client_r, up_w, count=True), self._pump(up_r, client_w, count=False))

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, count: bool) -> None:
        tail = b""
        try:
            while chunk := await reader.read(256 * 1024):
                writer.write(chunk)
                if count:
                    window = tail + chunk
                    for m in REQUEST_LINE.finditer(window):
                        if m.end() > len(tail):  # not already counted in the previous window
                            method = m.group().split(b" ", 1)[0].decode()
                            self.counts[method] = self.counts.get(method, 0) + 1
                    tail = window[-TAIL:]
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()


class CountedS3(SeaweedS3):
    """A SeaweedS3 whose clients (backfill's processes among them) go through a CountingProxy."""

    proxy: CountingProxy | None = None

    @property
    def endpoint_url(self) -> str:
        port = self.proxy.port if self.proxy is not None else self.port
        return f"http://{LOOPBACK}:{port}"


@dataclass(frozen=True)
class DbSnapshot:
    wal_lsn: str
    inserted: int
    updated: int
    deleted: int
    tables: dict[str, tuple[int, int, int, int]]  # table -> inserted, updated, HOT-updated, deleted


def _plain(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


def db_snapshot(url: str) -> DbSnapshot:
    with psycopg.connect(_plain(url), autocommit=True) as conn:
        # Counters reach the shared statistics when a backend goes idle, at most a second later.
        time.sleep(1.2)
        conn.execute("SELECT pg_stat_clear_snapshot()")
        lsn = str(conn.execute("SELECT pg_current_wal_lsn()").fetchone()[0])  # type: ignore[index]
        row = conn.execute(
            "SELECT tup_inserted, tup_updated, tup_deleted FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
        assert row is not None
        tables = {
            str(r[0]): (int(r[1]), int(r[2]), int(r[3]), int(r[4]))
            for r in conn.execute(
                "SELECT relname, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del FROM pg_stat_user_tables"
            )
        }
    return DbSnapshot(lsn, int(row[0]), int(row[1]), int(row[2]), tables)


def wal_bytes(url: str, before: DbSnapshot, after: DbSnapshot) -> int:
    with psycopg.connect(_plain(url), autocommit=True) as conn:
        row = conn.execute("SELECT pg_wal_lsn_diff(%s, %s)", (after.wal_lsn, before.wal_lsn)).fetchone()
    assert row is not None
    return int(row[0])


def table_bytes(url: str, *, compact: bool = False) -> dict[str, int]:
    """Each table's size with its indexes and TOAST; `compact` rewrites them first (VACUUM FULL),
    so the figure is what the live rows take, not the space deleted rows leave behind."""
    with psycopg.connect(_plain(url), autocommit=True) as conn:
        if compact:
            conn.execute("VACUUM FULL")
        rows = conn.execute("SELECT relname, pg_total_relation_size(relid) FROM pg_stat_user_tables").fetchall()
    return {str(r[0]): int(r[1]) for r in rows}


def redis_commands(url: str) -> int:
    """Commands the Redis has processed (the INFO call itself adds one)."""
    client = redis.Redis.from_url(url)
    try:
        return int(client.info("stats")["total_commands_processed"])
    finally:
        client.close()


def wal_breakdown(url: str, before: DbSnapshot, after: DbSnapshot) -> list[tuple[str, int, int, int]]:
    """WAL between two snapshots by resource manager (heap, btree, transaction...): records,
    their bytes and the full-page images' bytes among them. Empty without pg_walinspect."""
    try:
        with psycopg.connect(_plain(url), autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
            rows = conn.execute(
                'SELECT "resource_manager/record_type", count, combined_size, fpi_size '
                "FROM pg_get_wal_stats(%s::pg_lsn, %s::pg_lsn, false) "
                "WHERE count > 0 ORDER BY combined_size DESC",
                (before.wal_lsn, after.wal_lsn),
            ).fetchall()
    except psycopg.Error:
        return []
    return [(str(r[0]), int(r[1]), int(r[2]), int(r[3])) for r in rows]
