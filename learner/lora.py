"""LoRA training of the policy (issue 31): PEFT adapters on the decoder's linear layers, the base weights frozen.

`learner/model.py:load_policy` calls `apply_lora` when given a `LoraSpec` (`--lora-rank` > 0): PEFT injects its LoRA
layers into the transformers model in place (`peft.inject_adapter_in_model`), so `PolicyModel.hf` stays the
`*ForCausalLM` with `.model` and `.lm_head`, FSDP2 still shards one decoder layer per unit (frozen base weights and
trainable adapter weights in the same unit), and only `lora_A`/`lora_B` require gradients, so
`learner/step.py:make_optimizer` gives AdamW the adapter alone.

What leaves the learner is the adapter in PEFT's own format: `adapter_state` gives the tensors under the names PEFT
saves in `adapter_model.safetensors` (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`, ...),
`adapter_config` the `adapter_config.json` values, and `save_adapter` writes both (`hf-final`, loadable by
`PeftModel.from_pretrained`). The publisher and the serve's adapter slots consume these names.

peft is imported inside the functions that use it: it is needed only with `--lora-rank` > 0, and full fine-tuning
must keep working where it is not installed.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

PEFT_PREFIX = "base_model.model."  # PeftModel keeps the transformers model under `base_model.model`
# the file names PeftModel.save_pretrained writes and PeftModel.from_pretrained reads
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_LORA_MARK = ".lora_"  # every LoRA parameter's name holds it (lora_A, lora_B), no base weight's does


@dataclass(frozen=True)
class LoraSpec:
    """What to train instead of the full model: adapters of `rank` on the decoder-layer linear modules `targets`
    (empty: all of them), scaled by `alpha / rank`. `dropout` must be 0: the learner's logprobs must be the policy's
    that the serve samples from, and a dropout mask would make them random (see `LoraKnobs`)."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = ()
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoraSpec.rank is {self.rank}, expected >= 1 (0 means full fine-tuning: pass no spec)")
        if self.alpha <= 0:
            raise ValueError(f"LoraSpec.alpha is {self.alpha}, expected > 0 (e.g. the rank)")
        if self.dropout != 0:
            raise ValueError(
                f"LoraSpec.dropout is {self.dropout}, expected 0: RL logprobs must be deterministic (a dropout mask "
                "makes the learner's logprob of a token differ from the sampler's)"
            )


def decoder_linear_names(hf_model: torch.nn.Module) -> list[str]:
    """The names (last component) of the linear modules inside the decoder layers, sorted: what LoRA may target.

    For Llama- and Qwen2-style models: q_proj, k_proj, v_proj, o_proj (attention), gate_proj, up_proj, down_proj
    (MLP); for Qwen3-MoE the attention's alone (transformers keeps its experts as fused tensors and its router is no
    nn.Linear, so neither is adapted). The LM head and the embeddings are not among them: PolicyModel computes the
    logprobs from the LM head's weight directly (learner/model.py), so an adapter there would never be applied.
    """
    names = {
        name.rsplit(".", 1)[-1]
        for name, module in hf_model.model.layers.named_modules()
        if isinstance(module, torch.nn.Linear) and name
    }
    return sorted(names)


def resolve_targets(hf_model: torch.nn.Module, targets: tuple[str, ...]) -> list[str]:
    """`targets`, or every decoder-layer linear module when empty; a name the decoder layers lack is refused."""
    existing = decoder_linear_names(hf_model)
    unknown = [t for t in targets if t not in existing]
    if unknown:
        raise ValueError(
            f"lora targets {','.join(unknown)} (--lora-targets) name no linear module of "
            f"{type(hf_model).__name__}'s decoder layers; they have: {','.join(existing)}. Pass a comma-separated "
            "subset of these, or nothing for all of them"
        )
    return list(targets) if targets else existing


def apply_lora(hf_model: torch.nn.Module, spec: LoraSpec) -> torch.nn.Module:
    """Inject `spec`'s LoRA layers into `hf_model` in place and freeze everything else; returns `hf_model`.

    PEFT's default initialisation (A random, B zero) makes the adapted model equal the base one at version 0, so the
    serves' first policy (the base weights) is the learner's."""
    from peft import LoraConfig, inject_adapter_in_model  # optional dependency: see the module docstring

    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        target_modules=resolve_targets(hf_model, spec.targets),
        lora_dropout=spec.dropout,
        bias="none",
        task_type="CAUSAL_LM",  # in adapter_config.json: PeftModel.from_pretrained then builds PeftModelForCausalLM
    )
    return inject_adapter_in_model(config, hf_model)  # also sets requires_grad=False on every non-LoRA parameter


def is_lora_name(name: str) -> bool:
    """Whether a parameter or state-dict name is a LoRA adapter tensor."""
    return _LORA_MARK in name


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter as PEFT saves it: {`base_model.model.<hf name without the adapter name>`: full tensor on the CPU}.

    `model` is a PolicyModel built with a LoraSpec. Collective when sharded: every rank must call it (each adapter
    tensor is gathered whole, in the same order everywhere: adapters are small); rank 0 gets the tensors, the
    others `{}`. The tensors are copies, not views of the live weights.
    """
    from peft import get_peft_model_state_dict  # optional dependency: see the module docstring

    gathered = {}
    for name, param in model.named_parameters():
        if not is_lora_name(name):
            continue
        full = param.full_tensor() if isinstance(param, DTensor) else param  # collective when sharded
        gathered[name.removeprefix("hf.")] = full.detach().to("cpu", copy=True)
    if dist.is_initialized() and _is_sharded(model) and dist.get_rank() != 0:
        return {}
    # PEFT's own renaming (it drops the adapter name, `.default`), so the names are exactly those it saves and loads
    peft_state = get_peft_model_state_dict(model.hf, state_dict=gathered)
    return {PEFT_PREFIX + name: t for name, t in peft_state.items()}


def adapter_config(model: torch.nn.Module, base_model_path: str | Path) -> dict:
    """The adapter's `adapter_config.json` values (PEFT's LoraConfig: `r`, `lora_alpha`, `target_modules`, ...) with
    `base_model_name_or_path` the base model's directory."""
    config = model.hf.peft_config["default"]
    values = config.to_dict()
    values["base_model_name_or_path"] = str(base_model_path)
    # PEFT keeps some fields as sets (`target_modules`; `target_parameters`, empty, on a MoE model): sorted lists, for
    # JSON and for reading
    return {key: sorted(value) if isinstance(value, (set, frozenset)) else value for key, value in values.items()}


def save_adapter(model: torch.nn.Module, base_model_path: str | Path, out: str | Path, version: int) -> Path | None:
    """Collective: every rank gathers the adapter; rank 0 writes `out/adapter_config.json` and
    `out/adapter_model.safetensors` (tagged with `version`), what `PeftModel.from_pretrained(base, out)` loads, and
    the base model's tokenizer files. Returns `out` on rank 0, None elsewhere."""
    state = adapter_state(model)
    if dist.is_initialized() and _is_sharded(model) and dist.get_rank() != 0:
        return None
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for tokenizer_file in Path(base_model_path).glob("*token*"):
        shutil.copy(tokenizer_file, out / tokenizer_file.name)
    save_file(state, str(out / ADAPTER_WEIGHTS), {"format": "pt", "inflight_version": str(version)})
    (out / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(model, base_model_path), indent=2, sort_keys=True))
    return out


def save_merged(adapter_dir: str | Path, base_model_path: str | Path, out: str | Path, dtype: torch.dtype) -> Path:
    """The base model with the adapter in `adapter_dir` merged into its weights (PEFT's `merge_and_unload`), saved as
    a plain HF model directory at `out` (config, weights, tokenizer): what a serve without adapter slots loads.
    Runs on one process (rank 0 after `save_adapter`)."""
    from peft import PeftModel  # optional dependency: see the module docstring
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_model_path), dtype=dtype)
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    out = Path(out)
    shutil.copytree(base_model_path, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors*"))
    merged.save_pretrained(str(out))
    return out


def parameter_counts(model: torch.nn.Module) -> dict[str, int]:
    """`trainable_params` (what the optimizer updates) and `total_params` of the model (global counts: a sharded
    DTensor's numel is its full tensor's)."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"trainable_params": trainable, "total_params": sum(p.numel() for p in model.parameters())}


def _is_sharded(model: torch.nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())
