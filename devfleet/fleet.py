"""A simulated inference fleet: the real Dynamo frontend + N mocker workers on loopback.

Every process runs in its own process group (so stop/kill also reaches anything it
spawns) from the dedicated dynamo virtualenv, with file-based discovery in a
per-fleet scratch directory: no etcd/NATS, and two fleets never see each other.
Readiness and metrics probes use urllib so devfleet itself needs no HTTP client.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, NamedTuple

from . import install, model

LOOPBACK = "127.0.0.1"

# ---------------------------------------------------------------------------
# small process/port helpers (shared with devfleet.s3)
# ---------------------------------------------------------------------------

_given_ports: set[int] = set()
_ports_lock = threading.Lock()


# DYN_SYSTEM_PORT is parsed as an i16 by the Dynamo runtime ("expected i16 for key
# SYSTEM_PORT"), so metrics ports must be <= 32767 -- below Linux's ephemeral range,
# which is where bind(0) picks from. Such ports are drawn from this range instead.
SYSTEM_PORT_RANGE = (20000, 32767)


def _bindable(port: int, host: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = LOOPBACK, port_range: tuple[int, int] | None = None) -> int:
    """A currently free TCP port, never the same one twice in this process.

    The port is released before the child binds it, so a foreign process could
    grab it in between; remembering what we handed out at least avoids
    self-collisions when many ports are picked back to back. With `port_range`
    (inclusive) the port is drawn at random from that range instead of bind(0).
    """
    rng = random.Random()  # seeded from os.urandom: parallel test processes diverge
    with _ports_lock:
        for _ in range(500):
            if port_range:
                port = rng.randint(*port_range)
                if port in _given_ports or not _bindable(port, host):
                    continue
            else:
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind((host, 0))
                    port = s.getsockname()[1]
            if port not in _given_ports:
                _given_ports.add(port)
                return port
    raise RuntimeError("could not find a free port")


# Loopback probes must never go through an http_proxy from the environment.
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    """GET returning (status, body); (0, b"") when nothing answers."""
    try:
        with _opener.open(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read() if e.fp else b""
    except (OSError, ValueError):
        return 0, b""


_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Dynamo colours its logs even into files


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return _ANSI.sub("", "".join(text.splitlines(True)[-lines:]))


try:  # loaded in the parent: the child between fork and exec should do as little as possible
    _LIBC: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)
except OSError:
    _LIBC = None


def _set_parent_death_signal() -> None:
    """In the child before exec: SIGKILL it when the parent goes away (Linux).

    Caveat (why it is opt-in): the kernel fires this when the *thread* that
    forked exits, so only use it when the fleet is started from a long-lived
    thread (e.g. the main thread of a CLI or a test session).
    """
    if _LIBC is not None:
        _LIBC.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


def _proc_start_ticks(pid: int) -> str | None:
    """Process start time (field 22 of /proc/PID/stat): tells a live owner from PID reuse."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _process_env_has(pid: int, entry: str) -> bool:
    try:
        return entry.encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def reap_stale_fleets(run_root: Path) -> list[int]:
    """SIGKILL process groups of fleets whose owning process died without stop().

    Each fleet records its owner and process groups in RUN_DIR/pids.json. A group
    is killed only if its leader still carries that fleet's DYN_FILE_KV in its
    environment, so a recycled PID is never touched. Returns the killed pgids.
    """
    killed: list[int] = []
    for pid_file in Path(run_root).glob("*/pids.json"):
        try:
            info = json.loads(pid_file.read_text())
        except (OSError, ValueError):
            continue
        owner = info.get("owner_pid")
        if owner and _proc_start_ticks(owner) == info.get("owner_start"):
            continue  # owner still running: not stale
        marker = f"DYN_FILE_KV={pid_file.parent / 'kv'}"
        for pgid in info.get("pgids", []):
            if _process_env_has(pgid, marker):
                try:
                    os.killpg(pgid, signal.SIGKILL)
                    killed.append(pgid)
                except (ProcessLookupError, PermissionError):
                    pass
        pid_file.unlink(missing_ok=True)
    return killed


class ManagedProcess:
    """One child process in its own session/process group, logging to a file."""

    def __init__(
        self,
        name: str,
        cmd: Sequence[str],
        env: Mapping[str, str],
        log_path: Path,
        cwd: Path | None = None,
        die_with_parent: bool = False,
    ):
        self.name = name
        self.die_with_parent = die_with_parent
        self.cmd = [str(c) for c in cmd]
        self.env = dict(env)
        self.log_path = Path(log_path)
        self.cwd = cwd
        self.popen: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    def start(self) -> None:
        if self.alive():
            raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== devfleet: starting {self.name}: {' '.join(self.cmd)}\n".encode())
            log.flush()
            # start_new_session: own process group, so killpg reaches grandchildren
            # and a Ctrl-C in the parent's terminal is not delivered to it twice.
            self.popen = subprocess.Popen(
                self.cmd,
                env=self.env,
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_set_parent_death_signal if self.die_with_parent else None,
            )

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal_group(self, sig: int) -> None:
        if self.popen is None:
            return
        try:
            os.killpg(self.popen.pid, sig)  # pgid == pid thanks to start_new_session
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> None:
        """SIGKILL the whole group and reap it."""
        self.signal_group(signal.SIGKILL)
        if self.popen is not None:
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def log_tail(self, lines: int = 30) -> str:
        return _tail(self.log_path, lines)


def stop_processes(procs: Sequence[ManagedProcess], grace: float = 8.0) -> None:
    """SIGTERM every group, wait up to `grace` seconds in total, then SIGKILL.

    The group is signalled even when the leader already exited, so stragglers it
    left behind are not orphaned.
    """
    started = [(p, p.popen) for p in procs if p.popen is not None]
    for p, _ in started:
        p.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for _, popen in started:
        try:
            popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p, popen in started:
        p.signal_group(signal.SIGKILL)  # no-op for groups that are fully gone
        try:
            popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


class FleetStartError(RuntimeError):
    pass


# ---------------------------------------------------------------------------
# the fleet
# ---------------------------------------------------------------------------


class WorkerMetrics(NamedTuple):
    role: str  # "agg" | "prefill" | "decode"
    url: str  # http://127.0.0.1:PORT/metrics


@dataclass
class Worker:
    index: int
    role: str
    system_port: int
    bootstrap_port: int | None
    proc: ManagedProcess

    @property
    def metrics_url(self) -> str:
        return f"http://{LOOPBACK}:{self.system_port}/metrics"


# DYN_LOG is a tracing filter. At plain "info" the frontend writes ~4 KB and each
# worker ~1 KB of log per request, which adds up in benchmarks; keep start-up and
# discovery messages but silence the per-request lines.
DEFAULT_LOG_LEVEL = (
    "info,dynamo_llm::http::service=warn,dynamo_runtime::pipeline::network::ingress::push_handler=warn,mm_routing=error"
)

_live_fleets: weakref.WeakSet[Fleet] = weakref.WeakSet()


@atexit.register
def _stop_leftover_fleets() -> None:
    for f in list(_live_fleets):
        try:
            f.stop()
        except Exception:  # noqa: BLE001 -- best effort at interpreter exit; keep stopping the others
            pass


class Fleet:
    """Dynamo frontend + mocker workers. Use as a context manager or start()/stop().

    Aggregated (default): `num_workers` mockers. Disaggregated: `num_prefill_workers`
    prefill mockers (each with its own bootstrap port) + `num_workers` decode
    mockers. Everything unset falls back to the mocker/frontend defaults.
    `die_with_parent` makes the children exit if this process dies (see
    `_set_parent_death_signal` for the thread caveat); without it, fleets of a
    SIGKILLed owner are reaped by the next Fleet.start() on the same run root.
    `ignore_unsupported_fields` makes the frontend accept (and drop) unknown
    top-level request fields instead of answering 400.
    `python`/`model_path` default to the shared venv and tiny model under the
    fleet home, installed/built on first use.
    """

    def __init__(
        self,
        *,
        http_port: int | None = None,
        http_host: str = LOOPBACK,
        num_workers: int = 2,
        model_path: Path | str | None = None,
        model_name: str = "tiny-chat",
        speedup_ratio: float = 1.0,
        num_gpu_blocks: int | None = None,
        block_size: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        kv_bytes_per_token: int | None = None,
        router_mode: str = "kv",
        router_queue_threshold: float | None = None,
        migration_limit: int | None = None,
        disaggregated: bool = False,
        num_prefill_workers: int = 1,
        frontend_args: Sequence[str] = (),
        worker_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        python: Path | str | None = None,
        run_dir: Path | str | None = None,
        keep_run_dir: bool = False,
        die_with_parent: bool = False,
        ignore_unsupported_fields: bool = False,
        log_level: str = DEFAULT_LOG_LEVEL,
        startup_timeout: float = 120.0,
    ):
        if num_workers < 1:
            raise ValueError("num_workers must be >= 1")
        if disaggregated and num_prefill_workers < 1:
            raise ValueError("num_prefill_workers must be >= 1 when disaggregated")
        self.http_port = http_port
        self.http_host = http_host  # the frontend only; workers always stay on loopback
        self.num_workers = num_workers
        self.model_path = Path(model_path) if model_path else None
        self.model_name = model_name
        self.speedup_ratio = speedup_ratio
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.kv_bytes_per_token = kv_bytes_per_token
        self.router_mode = router_mode
        self.router_queue_threshold = router_queue_threshold
        self.migration_limit = migration_limit
        self.disaggregated = disaggregated
        self.num_prefill_workers = num_prefill_workers if disaggregated else 0
        self.frontend_args = list(frontend_args)
        self.worker_args = list(worker_args)
        self.extra_env = dict(env or {})
        self.python = Path(python) if python else None
        self._run_dir_given = Path(run_dir) if run_dir else None
        self.keep_run_dir = keep_run_dir
        self.die_with_parent = die_with_parent
        self.ignore_unsupported_fields = ignore_unsupported_fields
        self.log_level = log_level
        self.startup_timeout = startup_timeout

        self.run_dir: Path | None = None
        self.frontend: ManagedProcess | None = None
        self.workers: list[Worker] = []
        self._started = False

    # -- public URLs ---------------------------------------------------------

    @property
    def origin(self) -> str:
        return f"http://{LOOPBACK}:{self.http_port}"

    @property
    def base_url(self) -> str:
        """OpenAI base URL, e.g. http://127.0.0.1:8000/v1."""
        return f"{self.origin}/v1"

    @property
    def frontend_metrics_url(self) -> str:
        return f"{self.origin}/metrics"

    @property
    def worker_metrics_urls(self) -> list[WorkerMetrics]:
        return [WorkerMetrics(w.role, w.metrics_url) for w in self.workers]

    def pids(self) -> list[int]:
        """PIDs (= process-group ids) of the processes currently running."""
        procs = ([self.frontend] if self.frontend else []) + [w.proc for w in self.workers]
        return [p.popen.pid for p in procs if p.popen is not None and p.alive()]

    # -- lifecycle -----------------------------------------------------------

    def __enter__(self) -> Fleet:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> Fleet:
        if self._started:
            raise RuntimeError("fleet already started")
        if self.python is None:
            self.python = install.ensure_dynamo_venv(install.default_venv_dir())
        if self.model_path is None:
            self.model_path = model.build_tiny_model(install.default_model_dir(self.model_name), name=self.model_name)
        root = install.default_run_root()
        # Clean up after owners that were SIGKILLed (e.g. a test run killed on timeout).
        reap_stale_fleets(root)
        if self._run_dir_given:
            reap_stale_fleets(self._run_dir_given.parent)
            self.run_dir = self._run_dir_given
            self.run_dir.mkdir(parents=True, exist_ok=True)
        else:
            root.mkdir(parents=True, exist_ok=True)
            self.run_dir = Path(tempfile.mkdtemp(prefix="fleet-", dir=root))
        if self.http_port is None:
            self.http_port = free_port()

        base_env = self._base_env()
        self.frontend = ManagedProcess(
            "frontend",
            self._frontend_cmd(),
            base_env,
            self.run_dir / "frontend.log",
            die_with_parent=self.die_with_parent,
        )
        self.workers = []
        roles = (
            ["prefill"] * self.num_prefill_workers + ["decode"] * self.num_workers
            if self.disaggregated
            else ["agg"] * self.num_workers
        )
        for i, role in enumerate(roles):
            system_port = free_port(port_range=SYSTEM_PORT_RANGE)
            bootstrap = free_port(port_range=SYSTEM_PORT_RANGE) if role == "prefill" else None
            wenv = dict(base_env, DYN_SYSTEM_PORT=str(system_port))
            proc = ManagedProcess(
                f"worker{i}-{role}",
                self._worker_cmd(role, bootstrap),
                wenv,
                self.run_dir / f"worker{i}-{role}.log",
                die_with_parent=self.die_with_parent,
            )
            self.workers.append(Worker(i, role, system_port, bootstrap, proc))

        self._started = True
        _live_fleets.add(self)
        try:
            # Workers first: the frontend then finds them on its first discovery scan.
            for w in self.workers:
                w.proc.start()
            self.frontend.start()
            self._record_pids()
            self._wait_ready(self.startup_timeout)
        except BaseException:
            self.keep_run_dir = True  # keep logs for post-mortem
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Terminate all process groups (SIGTERM, then SIGKILL); idempotent."""
        if not self._started:
            return
        procs = ([self.frontend] if self.frontend else []) + [w.proc for w in self.workers]
        stop_processes(procs)
        if self.run_dir:
            (self.run_dir / "pids.json").unlink(missing_ok=True)
        self._started = False
        _live_fleets.discard(self)
        if self.run_dir and not self.keep_run_dir and not self._run_dir_given:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def kill_worker(self, i: int) -> None:
        """SIGKILL worker i (fault injection). Its discovery entry goes stale for ~10 s."""
        self.workers[i].proc.kill()

    def restart_worker(self, i: int, timeout: float = 60.0) -> None:
        """(Re)start worker i with the same ports; wait until it serves metrics and the model is listed.

        The frontend may still hold the killed instance's stale registration for
        ~10 s, so a few requests can get 503 right after a kill/restart.
        """
        w = self.workers[i]
        if w.proc.alive():
            stop_processes([w.proc])
        w.proc.start()
        self._record_pids()
        deadline = time.monotonic() + timeout
        self._wait_metrics(deadline, [w])
        assert self.frontend is not None
        alive = sum(x.proc.alive() for x in self.workers)
        self._wait_frontend(deadline, alive, [self.frontend, w.proc])

    def wait_ready(self, timeout: float = 60.0) -> None:
        self._wait_ready(timeout)

    # -- internals -----------------------------------------------------------

    def _record_pids(self) -> None:
        assert self.run_dir is not None
        procs = ([self.frontend] if self.frontend else []) + [w.proc for w in self.workers]
        info = {
            "owner_pid": os.getpid(),
            "owner_start": _proc_start_ticks(os.getpid()),
            "pgids": [p.pid for p in procs if p.pid],
        }
        tmp = self.run_dir / "pids.json.tmp"
        tmp.write_text(json.dumps(info))
        os.replace(tmp, self.run_dir / "pids.json")

    def _base_env(self) -> dict[str, str]:
        assert self.run_dir is not None and self.python is not None
        home = self.run_dir / "home"
        (home / ".cache").mkdir(parents=True, exist_ok=True)
        (self.run_dir / "kv").mkdir(parents=True, exist_ok=True)
        (self.run_dir / "tmp").mkdir(parents=True, exist_ok=True)
        # Start from the caller's env minus anything that would redirect Python to
        # another venv or point Dynamo at shared infrastructure (etcd/NATS/other fleets).
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("DYN_", "ETCD_", "NATS_", "PYTHON", "VIRTUAL_ENV", "HF_"))
            and k not in ("TRANSFORMERS_CACHE",)
        }
        venv_bin = str(Path(self.python).parent)
        env.update(
            PATH=venv_bin + os.pathsep + env.get("PATH", ""),
            PYTHONUNBUFFERED="1",
            HOME=str(home),
            XDG_CACHE_HOME=str(home / ".cache"),  # frontend copies model cards here
            HF_HOME=str(home / ".cache" / "huggingface"),
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            DO_NOT_TRACK="1",
            TMPDIR=str(self.run_dir / "tmp"),
            DYN_LOG=self.log_level,
            DYN_FILE_KV=str(self.run_dir / "kv"),  # file discovery store, per fleet
            DYN_DISCOVERY_BACKEND="file",
            DYN_REQUEST_PLANE="tcp",
            DYN_EVENT_PLANE="zmq",
            DYN_TCP_RPC_HOST=LOOPBACK,
            DYN_TCP_RESPONSE_STREAM_HOST=LOOPBACK,
            DYN_EVENT_PLANE_HOST=LOOPBACK,
            DYN_SYSTEM_HOST=LOOPBACK,
            DYN_HTTP_RPC_HOST=LOOPBACK,  # prefill bootstrap host advertised to decode workers
        )
        if self.ignore_unsupported_fields:
            # The frontend rejects unknown top-level fields (e.g. "priority") with
            # 400 "Unsupported parameter(s)" unless told to ignore them.
            env["DYN_IGNORE_OPENAI_FE_UNSUPPORTED_FIELDS"] = "1"
        env.update(self.extra_env)
        return env

    _PLANES: ClassVar[tuple[str, ...]] = (
        "--discovery-backend",
        "file",
        "--request-plane",
        "tcp",
        "--event-plane",
        "zmq",
    )

    def _frontend_cmd(self) -> list[str]:
        cmd = [
            str(self.python),
            "-m",
            "dynamo.frontend",
            "--http-host",
            self.http_host,
            "--http-port",
            str(self.http_port),
            "--router-mode",
            self.router_mode,
            *self._PLANES,
        ]
        if self.router_queue_threshold is not None:
            cmd += ["--router-queue-threshold", str(self.router_queue_threshold)]
        if self.migration_limit is not None:
            cmd += ["--migration-limit", str(self.migration_limit)]
        return cmd + self.frontend_args

    def _worker_cmd(self, role: str, bootstrap_port: int | None) -> list[str]:
        cmd = [
            str(self.python),
            "-m",
            "dynamo.mocker",
            "--model-path",
            str(self.model_path),
            "--model-name",
            self.model_name,
            "--speedup-ratio",
            str(self.speedup_ratio),
            *self._PLANES,
        ]
        for flag, value in (
            ("--num-gpu-blocks-override", self.num_gpu_blocks),
            ("--block-size", self.block_size),
            ("--max-num-seqs", self.max_num_seqs),
            ("--max-num-batched-tokens", self.max_num_batched_tokens),
            ("--kv-bytes-per-token", self.kv_bytes_per_token),
        ):
            if value is not None:
                cmd += [flag, str(value)]
        if role != "agg":
            cmd += ["--disaggregation-mode", role]
        if bootstrap_port is not None:
            cmd += ["--bootstrap-ports", str(bootstrap_port)]
        return cmd + self.worker_args

    def _models_listed(self) -> bool:
        status, body = http_get(f"{self.base_url}/models")
        if status != 200:
            return False
        try:
            ids = [m.get("id") for m in json.loads(body).get("data", [])]
        except (ValueError, AttributeError):
            return False
        return self.model_name in ids

    def _check_alive(self, procs: Sequence[ManagedProcess] | None = None) -> None:
        if procs is None:
            procs = ([self.frontend] if self.frontend else []) + [w.proc for w in self.workers]
        for p in procs:
            if not p.alive():
                code = p.popen.returncode if p.popen else "?"
                raise FleetStartError(self._failure(f"{p.name} exited with code {code}"))

    def _registered_workers(self) -> int | None:
        """Workers the frontend's KV router has registered; None if it exports no such gauge."""
        status, body = http_get(self.frontend_metrics_url)
        if status != 200:
            return 0
        seen, count = False, 0
        for line in body.decode(errors="replace").splitlines():
            if line.startswith("dynamo_component_router_worker_registered{"):
                seen = True
                count += float(line.rsplit(" ", 1)[1]) >= 1
        return count if seen else None

    def _wait_frontend(self, deadline: float, expected_workers: int, procs: Sequence[ManagedProcess]) -> None:
        """Model listed; with the KV router also every worker (prefill ones included) registered.

        /v1/models lists the model as soon as one decode/agg worker is known, which in
        disaggregated mode can be before the prefill workers are.
        """
        while True:
            self._check_alive(procs)
            if self._models_listed():
                if self.router_mode != "kv":
                    return
                registered = self._registered_workers()
                if registered is not None and registered >= expected_workers:
                    return
            if time.monotonic() > deadline:
                raise FleetStartError(
                    self._failure(
                        f"model {self.model_name!r} not served at {self.base_url} with "
                        f"{expected_workers} worker(s) registered in time"
                    )
                )
            time.sleep(0.2)

    def _wait_metrics(self, deadline: float, workers: Sequence[Worker]) -> None:
        pending = list(workers)
        while pending:
            self._check_alive([w.proc for w in pending])
            pending = [w for w in pending if http_get(w.metrics_url)[0] != 200]
            if pending and time.monotonic() > deadline:
                names = ", ".join(w.proc.name for w in pending)
                raise FleetStartError(self._failure(f"metrics not answering for: {names}"))
            if pending:
                time.sleep(0.2)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self._check_alive()
        self._wait_metrics(deadline, self.workers)
        assert self.frontend is not None
        self._wait_frontend(deadline, len(self.workers), [self.frontend, *(w.proc for w in self.workers)])

    def _failure(self, what: str) -> str:
        parts = [f"devfleet: {what} (logs in {self.run_dir})"]
        procs = ([self.frontend] if self.frontend else []) + [w.proc for w in self.workers]
        for p in procs:
            parts.append(f"--- {p.log_path.name} (tail) ---\n{p.log_tail()}")
        return "\n".join(parts)
