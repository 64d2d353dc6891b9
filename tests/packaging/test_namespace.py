"""backfill installs as one top-level package (`backfill.api`, `backfill.jobs`, ...): installed from
its wheel into a virtualenv beside another distribution's top-level `api` package, it still starts."""

from __future__ import annotations

import os
import site
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import httpx
import pytest

from backfill.devfleet.processes import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _wheel(tmp: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp), str(ROOT)],
        check=True,
        timeout=300,
    )
    (wheel,) = tmp.glob("backfill-*.whl")
    return wheel


def test_the_wheel_holds_one_top_level_package(tmp_path: Path) -> None:
    names = zipfile.ZipFile(_wheel(tmp_path)).namelist()
    tops = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith((".dist-info", ".data"))}
    assert tops == {"backfill"}
    for part in ("api/app.py", "jobs/models.py", "scheduler/tasks.py", "storage/db.py", "migrations/env.py"):
        assert f"backfill/{part}" in names
    assert "backfill/migrations/script.py.mako" in names
    assert "backfill/api/dashboard/index.html" in names


def test_installed_beside_a_package_named_api_it_still_starts(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path / "dist")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    (purelib,) = Path(venv / "lib").glob("python*/site-packages")
    # Another distribution's top-level `api`, installed after backfill: it must not shadow anything.
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(purelib), str(wheel)],
        check=True,
        timeout=300,
    )
    other = purelib / "api"
    other.mkdir()
    (other / "__init__.py").write_text('raise ImportError("this is some other project\'s api package")\n')
    # backfill's dependencies come from the test environment's site-packages, added after the venv's
    # own (a .pth line adds a path; it does not load that folder's editable-install hooks).
    (purelib / "zz_deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")

    home = tmp_path / "home"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("BACKFILL_")}
    env.update(BACKFILL_HOME=str(home), BACKFILL_METRICS_DIR=str(home / "metrics"), PYTHONPATH="")
    probe = subprocess.run(
        [str(python), "-c", "import backfill.api.app, backfill.jobs.models; print(backfill.api.app.__file__)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.startswith(str(purelib)), probe.stdout  # the installed copy, not the checkout
    subprocess.run([str(python), "-m", "backfill", "migrate"], cwd=tmp_path, env=env, check=True, timeout=120)
    api = subprocess.Popen(
        [str(python), "-m", "backfill", "api", "--port", str(port)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert api.poll() is None, api.stdout.read().decode() if api.stdout else ""
            assert time.monotonic() < deadline, "the installed API did not become healthy"
            time.sleep(0.2)
    finally:
        api.terminate()
        api.wait(timeout=30)
