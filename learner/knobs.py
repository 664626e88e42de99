"""The learner's knobs, declared once and without torch: the train step's configs inherit them
(learner/step.py:TrainConfig, learner/losses.py:LossConfig), and the learner's flags reuse them
(inflight/learn/config.py generates its sections from these), so `--help` of `inflight.learn` and `inflight.run`
imports no train step. Imported by the learner process and by `inflight.run` (for the flags it forwards).
"""

from __future__ import annotations

from dataclasses import dataclass, field

LOSS_KINDS = ("tis", "ppo", "mask")
AGGREGATIONS = ("token", "sequence")
FUSED_MODES = ("auto", "on", "off")  # the fused LM head + loss (learner/fused_loss.py:fused_enabled)


@dataclass(frozen=True)
class LossSettings:
    """Which policy loss and how its token losses are aggregated (learner/losses.py: the loss of each kind)."""

    kind: str = field(default="tis", metadata={"help": "policy loss", "choices": LOSS_KINDS})  # the flag: --loss
    tis_cap: float = field(default=2.0, metadata={"help": "tis: cap on the importance ratio"})
    aggregation: str = field(default="token", metadata={"help": "loss aggregation", "choices": AGGREGATIONS})


@dataclass
class StepSettings:
    """The optimizer step and how the LM head and the loss are computed."""

    lr: float = field(default=1e-5, metadata={"help": "AdamW learning rate"})
    # None (in code only): the norm is measured, not clipped
    grad_clip: float | None = field(default=1.0, metadata={"help": "max gradient norm"})
    fused_loss: str = field(
        default="auto",
        metadata={
            "help": "LM head + policy loss in one pass (learner/fused_loss.py): auto = on CUDA with Triton; on = also "
            "elsewhere (torch); off",
            "choices": FUSED_MODES,
        },
    )
