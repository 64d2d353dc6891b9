"""What the Dynamo frontend and mocker processes need to run as an isolated fleet:
their environment, their command lines, and the frontend's readiness probes.

Discovery is file-based in a per-fleet scratch directory: no etcd/NATS, and two
fleets never see each other.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from .processes import LOOPBACK, http_get

# DYN_LOG is a tracing filter. At plain "info" the frontend writes ~4 KB and each
# worker ~1 KB of log per request, which adds up in benchmarks; keep start-up and
# discovery messages but silence the per-request lines.
DEFAULT_LOG_LEVEL = (
    "info,dynamo_llm::http::service=warn,dynamo_runtime::pipeline::network::ingress::push_handler=warn,mm_routing=error"
)

_PLANES: tuple[str, ...] = (
    "--discovery-backend",
    "file",
    "--request-plane",
    "tcp",
    "--event-plane",
    "zmq",
)


def fleet_env(
    *,
    run_dir: Path,
    python: Path,
    log_level: str,
    ignore_unsupported_fields: bool,
    extra_env: Mapping[str, str],
) -> dict[str, str]:
    """The environment every process of the fleet in `run_dir` starts from (creates its dirs)."""
    home = run_dir / "home"
    (home / ".cache").mkdir(parents=True, exist_ok=True)
    (run_dir / "kv").mkdir(parents=True, exist_ok=True)
    (run_dir / "tmp").mkdir(parents=True, exist_ok=True)
    # Start from the caller's env minus anything that would redirect Python to
    # another venv or point Dynamo at shared infrastructure (etcd/NATS/other fleets).
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DYN_", "ETCD_", "NATS_", "PYTHON", "VIRTUAL_ENV", "HF_"))
        and k not in ("TRANSFORMERS_CACHE",)
    }
    venv_bin = str(Path(python).parent)
    env.update(
        PATH=venv_bin + os.pathsep + env.get("PATH", ""),
        PYTHONUNBUFFERED="1",
        HOME=str(home),
        XDG_CACHE_HOME=str(home / ".cache"),  # frontend copies model cards here
        HF_HOME=str(home / ".cache" / "huggingface"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        DO_NOT_TRACK="1",
        TMPDIR=str(run_dir / "tmp"),
        DYN_LOG=log_level,
        DYN_FILE_KV=str(run_dir / "kv"),  # file discovery store, per fleet
        DYN_DISCOVERY_BACKEND="file",
        DYN_REQUEST_PLANE="tcp",
        DYN_EVENT_PLANE="zmq",
        DYN_TCP_RPC_HOST=LOOPBACK,
        DYN_TCP_RESPONSE_STREAM_HOST=LOOPBACK,
        DYN_EVENT_PLANE_HOST=LOOPBACK,
        DYN_SYSTEM_HOST=LOOPBACK,
        DYN_HTTP_RPC_HOST=LOOPBACK,  # prefill bootstrap host advertised to decode workers
    )
    if ignore_unsupported_fields:
        # The frontend rejects unknown top-level fields (e.g. "priority") with
        # 400 "Unsupported parameter(s)" unless told to ignore them.
        env["DYN_IGNORE_OPENAI_FE_UNSUPPORTED_FIELDS"] = "1"
    env.update(extra_env)
    return env


def frontend_cmd(
    *,
    python: Path,
    http_host: str,
    http_port: int,
    router_mode: str,
    router_queue_threshold: float | None,
    migration_limit: int | None,
    extra_args: Sequence[str],
) -> list[str]:
    cmd = [
        str(python),
        "-m",
        "dynamo.frontend",
        "--http-host",
        http_host,
        "--http-port",
        str(http_port),
        "--router-mode",
        router_mode,
        *_PLANES,
    ]
    if router_queue_threshold is not None:
        cmd += ["--router-queue-threshold", str(router_queue_threshold)]
    if migration_limit is not None:
        cmd += ["--migration-limit", str(migration_limit)]
    return cmd + list(extra_args)


def mocker_cmd(
    *,
    python: Path,
    model_path: Path,
    model_name: str,
    speedup_ratio: float,
    role: str,
    bootstrap_port: int | None,
    num_gpu_blocks: int | None,
    block_size: int | None,
    max_num_seqs: int | None,
    max_num_batched_tokens: int | None,
    kv_bytes_per_token: int | None,
    extra_args: Sequence[str],
) -> list[str]:
    """One mocker worker; `role` is "agg", "prefill" or "decode"; unset limits keep the mocker's defaults."""
    cmd = [
        str(python),
        "-m",
        "dynamo.mocker",
        "--model-path",
        str(model_path),
        "--model-name",
        model_name,
        "--speedup-ratio",
        str(speedup_ratio),
        *_PLANES,
    ]
    for flag, value in (
        ("--num-gpu-blocks-override", num_gpu_blocks),
        ("--block-size", block_size),
        ("--max-num-seqs", max_num_seqs),
        ("--max-num-batched-tokens", max_num_batched_tokens),
        ("--kv-bytes-per-token", kv_bytes_per_token),
    ):
        if value is not None:
            cmd += [flag, str(value)]
    if role != "agg":
        cmd += ["--disaggregation-mode", role]
    if bootstrap_port is not None:
        cmd += ["--bootstrap-ports", str(bootstrap_port)]
    return cmd + list(extra_args)


def model_endpoint_args(model_name: str | None) -> list[str]:
    """The `--endpoint` of a further model's workers (None: the default endpoint, the first model's)."""
    if model_name is None:
        return []
    component = "backend_" + "".join(c if c.isalnum() else "_" for c in model_name)
    return ["--endpoint", f"dyn://dynamo.{component}.generate"]


def model_listed(base_url: str, model_name: str) -> bool:
    """Whether the frontend's /v1/models lists `model_name` yet."""
    status, body = http_get(f"{base_url}/models")
    if status != 200:
        return False
    try:
        ids = [m.get("id") for m in json.loads(body).get("data", [])]
    except (ValueError, AttributeError):
        return False
    return model_name in ids


def registered_workers(frontend_metrics_url: str) -> int | None:
    """Workers the frontend's KV router has registered; None if it exports no such gauge."""
    status, body = http_get(frontend_metrics_url)
    if status != 200:
        return 0
    seen, count = False, 0
    for line in body.decode(errors="replace").splitlines():
        if line.startswith("dynamo_component_router_worker_registered{"):
            seen = True
            count += float(line.rsplit(" ", 1)[1]) >= 1
    return count if seen else None
