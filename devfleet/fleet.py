"""A simulated inference fleet: the real Dynamo frontend + N mocker workers on loopback.

Every process runs in its own process group from the dedicated dynamo
virtualenv (see `processes`), with file-based discovery in a per-fleet scratch
directory (see `dynamo_launch`). Aggregated or disaggregated (prefill + decode
workers) is a flag, not another class: the two differ only in worker roles.
"""

from __future__ import annotations

import atexit
import shutil
import signal
import tempfile
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from . import dynamo_launch, install, model
from .dynamo_launch import DEFAULT_LOG_LEVEL
from .length_front import LengthFront
from .processes import LOOPBACK, SYSTEM_PORT_RANGE, ManagedProcess, free_port, http_get, stop_processes
from .reaper import forget_fleet_pids, reap_stale_fleets, record_fleet_pids


class FleetStartError(RuntimeError):
    pass


class WorkerMetrics(NamedTuple):
    role: str  # "agg" | "prefill" | "decode"
    url: str  # http://127.0.0.1:PORT/metrics


@dataclass(frozen=True)
class ServedModel:
    """A further model behind the same frontend, on mocker workers of its own (aggregated),
    as a provider serves several models each on its own worker pools. `layers` sizes it (KV
    bytes a token, see `model.build_tiny_model`); `speedup_ratio` None runs it at the fleet's."""

    name: str
    num_workers: int = 1
    speedup_ratio: float | None = None
    layers: int | None = None
    model_path: Path | None = None


# The second model of `backfill up` and of the test stack, beside `tiny-chat`: four times its
# size (16 layers: 8192 KV bytes a token) and slower (at half the first model's speedup), on a
# worker of its own, so the two models' idle capacity differs as it does on a real fleet.
LARGE_MODEL = "tiny-chat-large"


def large_model(speedup_ratio: float, num_workers: int = 1) -> ServedModel:
    return ServedModel(LARGE_MODEL, num_workers=num_workers, speedup_ratio=speedup_ratio / 2, layers=16)


@dataclass
class Worker:
    index: int
    role: str
    system_port: int
    bootstrap_port: int | None
    proc: ManagedProcess
    model: str = ""  # the model it serves

    @property
    def metrics_url(self) -> str:
        return f"http://{LOOPBACK}:{self.system_port}/metrics"


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
    `processes._set_parent_death_signal` for the thread caveat); without it, fleets of a
    SIGKILLed owner are reaped by the next Fleet.start() on the same run root.
    `ignore_unsupported_fields` makes the frontend accept (and drop) unknown
    top-level request fields instead of answering 400.
    `python`/`model_path` default to the shared venv and tiny model under the
    fleet home, installed/built on first use.
    `more_models`: further models on workers of their own, after the first model's workers
    (so worker indexes of the first model do not move).
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
        default_max_tokens: int | None = None,
        more_models: Sequence[ServedModel] = (),
    ):
        """`default_max_tokens`: a request without a length limit gets this one (bounded by the
        context the prompt leaves), as a real engine gives its default; the mocker would answer
        400 (see `length_front`). Requests then go through that front on `http_port`."""
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
        self.default_max_tokens = default_max_tokens
        self.more_models = list(more_models)
        self._model_paths: dict[str, Path] = {}
        self._front: LengthFront | None = None
        self._engine_port: int | None = None  # the Dynamo frontend's own port

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
        return f"http://{LOOPBACK}:{self._engine_port or self.http_port}/metrics"

    @property
    def worker_metrics_urls(self) -> list[WorkerMetrics]:
        return [WorkerMetrics(w.role, w.metrics_url) for w in self.workers]

    @property
    def models(self) -> list[str]:
        """The models the frontend lists, the first one first."""
        return [self.model_name, *(m.name for m in self.more_models)]

    def model_workers(self, name: str) -> list[Worker]:
        return [w for w in self.workers if w.model == name]

    def pids(self) -> list[int]:
        """PIDs (= process-group ids) of the processes currently running."""
        return [p.popen.pid for p in self._procs() if p.popen is not None and p.alive()]

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
        self._model_paths = {self.model_name: self.model_path}
        for extra in self.more_models:
            self._model_paths[extra.name] = extra.model_path or model.build_tiny_model(
                install.default_model_dir(extra.name), name=extra.name, layers=extra.layers
            )
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
        if self.default_max_tokens is not None:
            self._engine_port = free_port()
            self._front = LengthFront(
                f"http://{LOOPBACK}:{self._engine_port}", port=self.http_port, default=self.default_max_tokens
            )

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
        placed = [(role, self.model_name) for role in roles]
        placed += [("agg", m.name) for m in self.more_models for _ in range(m.num_workers)]
        for i, (role, served) in enumerate(placed):
            system_port = free_port(port_range=SYSTEM_PORT_RANGE)
            bootstrap = free_port(port_range=SYSTEM_PORT_RANGE) if role == "prefill" else None
            wenv = dict(base_env, DYN_SYSTEM_PORT=str(system_port))
            proc = ManagedProcess(
                f"worker{i}-{role}",
                self._worker_cmd(role, bootstrap, served),
                wenv,
                self.run_dir / f"worker{i}-{role}.log",
                die_with_parent=self.die_with_parent,
            )
            self.workers.append(Worker(i, role, system_port, bootstrap, proc, served))

        self._started = True
        _live_fleets.add(self)
        try:
            if self._front is not None:
                self._front.start()
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
        stop_processes(self._procs())
        if self._front is not None:
            self._front.stop()
            self._front = None
        if self.run_dir:
            forget_fleet_pids(self.run_dir)
        self._started = False
        _live_fleets.discard(self)
        if self.run_dir and not self.keep_run_dir and not self._run_dir_given:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def kill_now(self) -> None:
        """SIGKILL every process group at once, without waiting (an owner's last resort)."""
        for p in self._procs():
            p.signal_group(signal.SIGKILL)

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

    def _procs(self) -> list[ManagedProcess]:
        return ([self.frontend] if self.frontend else []) + [w.proc for w in self.workers]

    def _record_pids(self) -> None:
        assert self.run_dir is not None
        record_fleet_pids(self.run_dir, [p.pid for p in self._procs() if p.pid])

    def _base_env(self) -> dict[str, str]:
        assert self.run_dir is not None and self.python is not None
        return dynamo_launch.fleet_env(
            run_dir=self.run_dir,
            python=self.python,
            log_level=self.log_level,
            ignore_unsupported_fields=self.ignore_unsupported_fields,
            extra_env=self.extra_env,
        )

    def _frontend_cmd(self) -> list[str]:
        assert self.python is not None and self.http_port is not None
        return dynamo_launch.frontend_cmd(
            python=self.python,
            http_host=self.http_host if self._front is None else LOOPBACK,
            http_port=self._engine_port or self.http_port,
            router_mode=self.router_mode,
            router_queue_threshold=self.router_queue_threshold,
            migration_limit=self.migration_limit,
            extra_args=self.frontend_args,
        )

    def _worker_cmd(self, role: str, bootstrap_port: int | None, served: str | None = None) -> list[str]:
        assert self.python is not None and self.model_path is not None
        served = served or self.model_name
        extra = next((m for m in self.more_models if m.name == served), None)
        speedup = extra.speedup_ratio if extra is not None and extra.speedup_ratio is not None else self.speedup_ratio
        return dynamo_launch.mocker_cmd(
            python=self.python,
            model_path=self._model_paths.get(served, self.model_path),
            model_name=served,
            speedup_ratio=speedup,
            role=role,
            bootstrap_port=bootstrap_port,
            num_gpu_blocks=self.num_gpu_blocks,
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            kv_bytes_per_token=self.kv_bytes_per_token,
            # A further model registers on an endpoint of its own: workers of two models on
            # one endpoint are one pool to the router, and the second model's worker exits.
            extra_args=[*self.worker_args, *dynamo_launch.model_endpoint_args(served if extra is not None else None)],
        )

    def _check_alive(self, procs: Sequence[ManagedProcess] | None = None) -> None:
        for p in self._procs() if procs is None else procs:
            if not p.alive():
                code = p.popen.returncode if p.popen else "?"
                raise FleetStartError(self._failure(f"{p.name} exited with code {code}"))

    def _wait_frontend(self, deadline: float, expected_workers: int, procs: Sequence[ManagedProcess]) -> None:
        """Model listed; with the KV router also every worker (prefill ones included) registered.

        /v1/models lists the model as soon as one decode/agg worker is known, which in
        disaggregated mode can be before the prefill workers are.
        """
        while True:
            self._check_alive(procs)
            if all(dynamo_launch.model_listed(self.base_url, name) for name in self.models):
                if self.router_mode != "kv":
                    return
                registered = dynamo_launch.registered_workers(self.frontend_metrics_url)
                if registered is not None and registered >= expected_workers:
                    return
            if time.monotonic() > deadline:
                raise FleetStartError(
                    self._failure(
                        f"models {self.models!r} not served at {self.base_url} with "
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
        for p in self._procs():
            parts.append(f"--- {p.log_path.name} (tail) ---\n{p.log_tail()}")
        return "\n".join(parts)
