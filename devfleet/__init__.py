"""devfleet: a simulated inference fleet for development, tests and benchmarks.

* `Fleet`: the real NVIDIA Dynamo OpenAI frontend + KV router in front of N
  `dynamo.mocker` workers (simulated vLLM engines, no GPU), all on loopback.
* `SeaweedS3`: a local S3-compatible object store (SeaweedFS `weed mini`).
* `build_tiny_model`: the tokenizer/config directory the mocker serves.
* `ensure_dynamo_venv` / `ensure_seaweedfs`: install/locate the binaries.

CLI: `python -m backfill.devfleet install | up | s3` (see `python -m backfill.devfleet -h`).
"""

from .fleet import Fleet, FleetStartError, WorkerMetrics
from .install import (
    default_model_dir,
    default_run_root,
    default_venv_dir,
    ensure_dynamo_venv,
    ensure_seaweedfs,
    fleet_home,
)
from .model import build_tiny_model
from .s3 import S3StartError, SeaweedS3

__all__ = [
    "Fleet",
    "FleetStartError",
    "S3StartError",
    "SeaweedS3",
    "WorkerMetrics",
    "build_tiny_model",
    "default_model_dir",
    "default_run_root",
    "default_venv_dir",
    "ensure_dynamo_venv",
    "ensure_seaweedfs",
    "fleet_home",
]
