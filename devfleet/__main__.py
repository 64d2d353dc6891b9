"""`python -m backfill.devfleet install | up | s3`: run the simulated fleet by hand."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path


def _on_sigterm(signum: int, frame: object) -> None:  # let `finally` blocks stop the children
    raise KeyboardInterrupt


def _cmd_install(args: argparse.Namespace) -> int:
    from .install import default_model_dir, default_venv_dir, ensure_dynamo_venv, fleet_home
    from .model import build_tiny_model

    t0 = time.monotonic()
    py = ensure_dynamo_venv(default_venv_dir())
    model = build_tiny_model(default_model_dir(args.model_name), name=args.model_name)
    print(f"fleet home: {fleet_home()}")
    print(f"dynamo python: {py}")
    print(f"model: {model}")
    if not args.no_vllm:
        from .vllm_install import build_vllm_model, ensure_vllm_venv

        vllm_py = ensure_vllm_venv()
        print(f"vllm python: {vllm_py}")
        print(f"vllm model: {build_vllm_model(python=vllm_py)}")
    print(f"done in {time.monotonic() - t0:.1f}s")
    return 0


def _cmd_up(args: argparse.Namespace) -> int:
    from .fleet import Fleet

    fleet = Fleet(
        http_port=args.port,
        http_host=args.host,
        num_workers=args.workers,
        model_path=args.model_path,
        model_name=args.model_name,
        speedup_ratio=args.speedup_ratio,
        num_gpu_blocks=args.num_gpu_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_bytes_per_token=args.kv_bytes_per_token,
        router_mode=args.router_mode,
        router_queue_threshold=args.router_queue_threshold,
        migration_limit=args.migration_limit,
        disaggregated=args.disaggregated,
        num_prefill_workers=args.prefill_workers,
        frontend_args=args.frontend_arg,
        worker_args=args.worker_arg,
        ignore_unsupported_fields=args.ignore_unsupported_fields,
        keep_run_dir=args.keep_logs,
        die_with_parent=True,  # started from the main thread, which lives as long as the CLI
        **({"log_level": args.log_level} if args.log_level else {}),
    )
    try:
        fleet.start()
        print(f"base URL:         {fleet.base_url}   (model: {fleet.model_name})")
        print(f"frontend metrics: {fleet.frontend_metrics_url}")
        for i, (role, url) in enumerate(fleet.worker_metrics_urls):
            print(f"worker {i} ({role}):  {url}")
        print(f"logs:             {fleet.run_dir}")
        print("Ctrl-C to stop.", flush=True)
        warned: set[int] = set()
        frontend = fleet.frontend
        assert frontend is not None
        while True:
            time.sleep(1)
            if not frontend.alive():
                print("frontend exited:\n" + frontend.log_tail(), file=sys.stderr)
                return 1
            for w in fleet.workers:
                if not w.proc.alive() and w.index not in warned:
                    warned.add(w.index)
                    print(f"warning: worker {w.index} exited; log {w.proc.log_path}", file=sys.stderr)
    except KeyboardInterrupt:
        print("stopping...", file=sys.stderr)
        return 0
    finally:
        fleet.stop()


def _cmd_s3(args: argparse.Namespace) -> int:
    from .s3 import SeaweedS3

    s3 = SeaweedS3(port=args.port, data_dir=args.dir, access_key=args.access_key, secret_key=args.secret_key)
    try:
        s3.start()
        for b in args.bucket:
            s3.create_bucket(b)
        print(f"endpoint:   {s3.endpoint_url}   (region {s3.region}, path-style)")
        print(f"access key: {s3.access_key}")
        print(f"secret key: {s3.secret_key}")
        print(f"data dir:   {s3.data_dir}")
        if args.bucket:
            print(f"buckets:    {', '.join(args.bucket)}")
        print("Ctrl-C to stop.", flush=True)
        while s3.proc is not None and s3.proc.alive():
            time.sleep(1)
        print("weed exited:\n" + (s3.proc.log_tail() if s3.proc else ""), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("stopping...", file=sys.stderr)
        return 0
    finally:
        s3.stop()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m backfill.devfleet",
        description="Simulated inference fleet (Dynamo frontend + mocker workers) and local S3. "
        "State lives in $BACKFILL_FLEET_HOME or .fleet/ at the repository root.",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("install", help="create the dynamo and vLLM venvs and build the tiny models")
    p.add_argument("--model-name", default="tiny-chat")
    p.add_argument("--no-vllm", action="store_true", help="skip vLLM on CPU (the engine tests then install it)")
    p.set_defaults(func=_cmd_install)

    p = sub.add_parser("up", help="run frontend + mocker workers until Ctrl-C")
    p.add_argument("--host", default="127.0.0.1", help="frontend HTTP interface (0.0.0.0 in a container)")
    p.add_argument("--port", type=int, default=8000, help="frontend HTTP port (0 = pick a free one)")
    p.add_argument("--workers", type=int, default=2, help="aggregated workers (decode workers with --disaggregated)")
    p.add_argument("--model-name", default="tiny-chat")
    p.add_argument(
        "--model-path", type=Path, default=None, help="model dir (default: the tiny model under the fleet home)"
    )
    p.add_argument("--speedup-ratio", type=float, default=1.0, help="0 = no simulated delay")
    p.add_argument("--num-gpu-blocks", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--kv-bytes-per-token", type=int, default=None)
    p.add_argument("--router-mode", default="kv")
    p.add_argument("--router-queue-threshold", type=float, default=None)
    p.add_argument("--migration-limit", type=int, default=None)
    p.add_argument("--disaggregated", action="store_true", help="prefill/decode split")
    p.add_argument("--prefill-workers", type=int, default=1)
    p.add_argument(
        "--ignore-unsupported-fields",
        action="store_true",
        help="frontend drops unknown request fields instead of answering 400",
    )
    p.add_argument(
        "--frontend-arg",
        action="append",
        default=[],
        help="extra frontend argument (repeatable; use --frontend-arg=--flag)",
    )
    p.add_argument(
        "--worker-arg", action="append", default=[], help="extra mocker argument (repeatable; use --worker-arg=--flag)"
    )
    p.add_argument("--log-level", default=None, help="DYN_LOG filter for all processes")
    p.add_argument("--keep-logs", action="store_true", help="keep the run dir after stopping")
    p.set_defaults(func=_cmd_up)

    p = sub.add_parser("s3", help="run SeaweedFS S3 until Ctrl-C")
    p.add_argument("--port", type=int, default=9006, help="S3 port (0 = pick a free one)")
    p.add_argument("--dir", type=Path, default=None, help="data dir (default: temporary)")
    p.add_argument("--access-key", default="testkey")
    p.add_argument("--secret-key", default="testsecret")
    p.add_argument("--bucket", action="append", default=[], help="bucket to create (repeatable)")
    p.set_defaults(func=_cmd_s3)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "port", None) == 0:
        args.port = None
    signal.signal(signal.SIGTERM, _on_sigterm)
    # A shell starts background jobs with SIGINT ignored; make Ctrl-C/kill -INT work anyway.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
