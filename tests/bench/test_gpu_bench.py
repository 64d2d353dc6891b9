"""The GPU bench (bench.gpu) end to end on CPU with a tiny shape: the engine answers as an
OpenAI-compatible fleet, `backfill up` runs embedded against it without the simulated fleet, and
each phase (offline, direct, backfill) answers every line with exactly its max_tokens."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest

from backfill.devfleet.install import venv_python
from backfill.devfleet.vllm_install import default_vllm_venv_dir, is_vllm_venv_ready
from bench.gpu import run as gpu_run

ROOT = Path(__file__).resolve().parents[2]
# On the GPU machine's image already (its packages), or not needed by the embedded mode.
ON_IMAGE_OR_UNUSED = {"tokenizers", "psutil", "jinja2", "boto3", "psycopg", "openai"}


def test_the_wheels_list_covers_backfills_dependencies_at_versions_they_accept() -> None:
    """Every direct dependency is listed, and each listed version meets what backfill and the
    installed dependencies require of it. Not equal to the venv's: a fresh install resolves the
    newest releases (CI's got opentelemetry-api 1.45.3 beside the list's 1.45.2)."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pinned = {}
    for raw in (ROOT / "bench/gpu/wheels.txt").read_text().splitlines():
        if raw.strip() and not raw.startswith("#"):
            name, _, version = raw.partition("==")
            pinned[canonicalize_name(name)] = version
    deps = [Requirement(d) for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
    wanted = {canonicalize_name(d.name) for d in deps} - ON_IMAGE_OR_UNUSED
    assert wanted <= pinned.keys(), f"add to bench/gpu/wheels.txt: {sorted(wanted - pinned.keys())}"
    # What each listed package is required to be, by backfill and by every listed package.
    required = [*deps]
    for name in pinned:
        required += [Requirement(r) for r in metadata.requires(name) or []]
    refused = {
        f"{r.name}{r.specifier}": pinned[canonicalize_name(r.name)]
        for r in required
        if canonicalize_name(r.name) in pinned
        and (r.marker is None or r.marker.evaluate({"extra": ""}))
        and not r.specifier.contains(pinned[canonicalize_name(r.name)], prereleases=True)
    }
    assert not refused, f"bench/gpu/wheels.txt lists versions its packages refuse: {refused}"


def test_prompts_have_the_asked_token_count(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    from backfill.devfleet.model import build_tiny_model

    model = build_tiny_model(tmp_path / "tok")
    texts = gpu_run.prompts(model / "tokenizer.json", 5, 40)
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    assert len(set(texts)) == 5
    assert all(len(tok.encode(t, add_special_tokens=False).ids) == 40 for t in texts)


@pytest.mark.e2e
@pytest.mark.slow
def test_the_bench_runs_end_to_end_on_cpu(tmp_path: Path) -> None:
    venv = default_vllm_venv_dir()
    if not is_vllm_venv_ready(venv):
        pytest.skip("no Python with torch and transformers (the vLLM-on-CPU venv is not installed)")
    results = gpu_run.main(
        [
            *("--shape", "tiny", "--device", "cpu", "--lines", "16", "--concurrency", "4"),
            *("--prompt-tokens", "24", "--output-tokens", "6", "--repeat", "1"),
            *("--engine-python", str(venv_python(venv)), "--out", str(tmp_path / "out")),
        ]
    )
    kinds = [p["kind"] for p in results["phases"]]
    assert kinds == ["offline", "direct", "backfill"], results
    assert results["all_ok"], results["phases"]
    assert all(p["completion_tokens"] == 16 * 6 for p in results["phases"])
    backfill = results["phases"][-1]
    # backfill held no more than its fixed limit at the engine.
    assert backfill["inflight_max"] <= 4
    assert backfill["create_to_first_s"] >= 0 and backfill["last_to_completed_s"] >= 0
    # Embedded, with the fleet given: the simulated Dynamo fleet was neither installed nor started.
    up_log = (tmp_path / "out" / "up.log").read_text()
    assert "simulated" not in up_log and "fleet-install" not in up_log
    assert (tmp_path / "out" / "gpu_bench.json").exists()
