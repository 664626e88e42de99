"""The learner's LoRA side (`--lora-rank` > 0, issue 31): the spec from the flags, and what leaves the learner instead
of full weights — the adapter, each publish and in `hf-final`.

`inflight/learn/app.py:Learner` builds an `AdapterOutputs` when the policy has adapters (learner/lora.py): its `spec`
goes to the publisher, which marks every update as an adapter update (the serves check it against the adapter they
serve), and `RankSender.publish` (inflight/learn/publisher.py) sends `learner/lora.py:adapter_state` — PEFT's saved
names, what the serve's adapter slot loads (vllm_patches/adapter.py) — in place of the full weights;
`AdapterOutputs.export` writes `hf-final`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from inflight.learn.config import LearnConfig
from inflight.wire.records import StepMetrics
from inflight.wire.weights import AdapterSpec
from learner.lora import LoraSpec, adapter_config, parameter_counts, save_adapter, save_merged
from learner.model import PolicyModel

log = logging.getLogger("inflight.learn")


def lora_spec(cfg: LearnConfig) -> LoraSpec | None:
    """The LoRA adapters `--lora-rank` asks for (`--lora-alpha` 0 = the rank), None for full fine-tuning."""
    if cfg.lora_rank == 0:
        return None
    alpha = cfg.lora_alpha or float(cfg.lora_rank)
    return LoraSpec(cfg.lora_rank, alpha, cfg.lora_target_names(), cfg.lora_dropout)


def counted_parameters(model: PolicyModel) -> dict[str, int]:
    """`learner/lora.py:parameter_counts`, logged, and kept to the fields StepMetrics declares: the step lines get
    `trainable_params` and `total_params` once inflight/wire/records.py has them (StepMetrics refuses unknown fields,
    and the wire records are not this module's to change)."""
    counts = parameter_counts(model)
    log.info("trainable parameters %(trainable_params)d of %(total_params)d", counts)
    return {name: n for name, n in counts.items() if name in StepMetrics.__struct_fields__}


class AdapterOutputs:
    """One rank's LoRA outputs: the adapter's spec for the publisher and the export at the end."""

    def __init__(self, cfg: LearnConfig, model: PolicyModel, model_path: Path, rank: int):
        self.cfg, self.model, self.model_path, self.rank = cfg, model, model_path, rank

    def spec(self) -> AdapterSpec:
        """The adapter's shape as the serves check it (inflight/wire/weights.py:AdapterSpec): rank, alpha, targets."""
        config = adapter_config(self.model, self.model_path)
        return AdapterSpec(int(config["r"]), float(config["lora_alpha"]), sorted(config["target_modules"]))

    def export(self, run_dir: Path, version: int) -> None:
        """Collective: `<run_dir>/hf-final` gets the adapter in PEFT's format (`PeftModel.from_pretrained` loads
        it); with `--lora-merge-final` rank 0 also writes the merged model to `<run_dir>/hf-final-merged`."""
        out = save_adapter(self.model, self.model_path, run_dir / "hf-final", version)
        if out is not None and self.cfg.lora_merge_final:
            save_merged(out, self.model_path, run_dir / "hf-final-merged", getattr(torch, self.cfg.dtype))
