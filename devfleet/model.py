"""Build a tiny, self-contained "model" directory for the Dynamo mocker.

The mocker never runs weights: it only needs a tokenizer (the frontend tokenizes
prompts, and the KV router hashes token blocks) and a Llama-style config.json
(the mocker derives KV bytes per token from it). No model hub is reachable in
development/CI, so the tokenizer is trained locally on the Python standard
library sources, which are always present and give realistic-looking token
counts for English-ish and code-ish prompts.

Only the `tokenizers` package is needed: the transformers-side files
(tokenizer_config.json, special_tokens_map.json, config.json) are plain JSON
written directly, so the main virtualenv does not need transformers.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported lazily at run time: only building the model needs it
    from tokenizers import Tokenizer

# Bump when the directory layout or contents change so old builds get rebuilt.
MODEL_FORMAT_VERSION = 1
_MARKER = ".devfleet-model-complete"

VOCAB_SIZE = 3072
# Enough text for a vocabulary of a few thousand tokens; training stays ~seconds.
_MAX_TRAINING_BYTES = 2_000_000

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]  # ids 0..4, in this order

# ChatML-style template. Written for both Jinja2 (transformers) and minijinja
# (the Dynamo frontend): no Python-only filters. List-of-parts content (the
# OpenAI "content": [{"type": "text", ...}] form) is flattened to its text.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Small Llama geometry. KV bytes/token = layers * 2 * kv_heads * head_dim * 2 (bf16)
# = 4 * 2 * 2 * 64 * 2 = 2048. max_position_embeddings is large so long prompts
# (agentic contexts) are accepted by the frontend.
_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
}


def _training_files(limit_bytes: int = _MAX_TRAINING_BYTES) -> list[str]:
    """Top-level stdlib modules in sorted order, capped by size (deterministic)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files: list[str] = []
    total = 0
    for p in sorted(stdlib.glob("*.py")):
        try:
            size = p.stat().st_size
        except OSError:
            continue
        if total + size > limit_bytes and files:
            continue  # skip big ones, keep filling with smaller files
        files.append(str(p))
        total += size
        if total >= limit_bytes:
            break
    if not files:
        raise RuntimeError(f"no Python sources found under {stdlib} to train a tokenizer")
    return files


def _train_tokenizer(vocab_size: int) -> Tokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Keeps offsets right; adds no special tokens (the chat template adds BOS).
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(_training_files(), trainer)
    return tok


def _special_token_entry(content: str) -> dict[str, Any]:
    return {
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def is_complete(path: Path) -> bool:
    marker = Path(path) / _MARKER
    try:
        return bool(json.loads(marker.read_text())["version"] == MODEL_FORMAT_VERSION)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def build_tiny_model(
    path: Path, name: str = "tiny-chat", vocab_size: int = VOCAB_SIZE, *, layers: int | None = None
) -> Path:
    """Create (once) a tokenizer + Llama-style config directory at ``path``.

    `layers` sizes the model (the KV bytes a token takes grow with it: 4 layers, the default,
    take 2048 bytes; 16 take 8192), so two models of one fleet can differ in size.

    Idempotent: returns immediately when a complete build of the current format is
    already there. The build goes to a sibling temp dir and is renamed into place,
    so a crash or a concurrent builder never leaves a half-written model behind.
    """
    path = Path(path)
    if is_complete(path):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    tmp.chmod(0o755)  # mkdtemp makes it 0700; the result should be a normal directory
    try:
        tok = _train_tokenizer(vocab_size)
        tok.save(str(tmp / "tokenizer.json"))
        ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
        real_vocab = tok.get_vocab_size()

        _write_json(
            tmp / "tokenizer_config.json",
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": BOS,
                "eos_token": EOS,
                "pad_token": PAD,
                "unk_token": None,
                "add_bos_token": False,
                "add_eos_token": False,
                "clean_up_tokenization_spaces": False,
                "model_max_length": _LLAMA_CONFIG["max_position_embeddings"],
                "chat_template": CHAT_TEMPLATE,
                "added_tokens_decoder": {str(ids[t]): _special_token_entry(t) for t in SPECIAL_TOKENS},
                "additional_special_tokens": [IM_START, IM_END],
            },
        )
        _write_json(
            tmp / "special_tokens_map.json",
            {
                "bos_token": BOS,
                "eos_token": EOS,
                "pad_token": PAD,
                "additional_special_tokens": [IM_START, IM_END],
            },
        )
        config = dict(_LLAMA_CONFIG)
        config.update(
            vocab_size=real_vocab,
            bos_token_id=ids[BOS],
            # <|im_end|> ends an assistant turn in the template; </s> ends a document.
            eos_token_id=[ids[EOS], ids[IM_END]],
            pad_token_id=ids[PAD],
            _name_or_path=name,
        )
        if layers is not None:
            config["num_hidden_layers"] = layers
        _write_json(tmp / "config.json", config)
        _write_json(
            tmp / "generation_config.json",
            {
                "bos_token_id": ids[BOS],
                "eos_token_id": [ids[EOS], ids[IM_END]],
                "pad_token_id": ids[PAD],
            },
        )
        _write_json(tmp / _MARKER, {"version": MODEL_FORMAT_VERSION, "name": name})

        if path.exists():
            # An incomplete or outdated build: replace it.
            shutil.rmtree(path)
        try:
            os.replace(tmp, path)
        except OSError:
            # Lost a race with a concurrent builder that finished first.
            if not is_complete(path):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"devfleet: built tiny model '{name}' at {path}", file=sys.stderr)
    return path
