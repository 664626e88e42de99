"""`LearnConfig`: every knob of `python -m inflight.learn`, with defaults that train the embedded demo on CPU.

The knobs come in groups by concern (the sockets and devices, the loss, the precision, publishing, the run directory),
each a small dataclass with its own checks; `LearnConfig` inherits them all plus the knobs both sides share
(inflight/wire/contract.py:SharedKnobs), so the flags stay one flat list. The knobs the train step is built from are
declared by the learner (learner/knobs.py, whose sections learner/step.py:TrainConfig and learner/losses.py:LossConfig
inherit) and reused here as generated sections (`TrainStepKnobs`, `PolicyLossKnobs`); inflight/learn/app.py:
train_config builds those configs back from them. Read by the learner's process (inflight/learn/app.py) and by
`inflight.run` for the knobs it forwards.
"""

from __future__ import annotations

from dataclasses import dataclass

from inflight.config import knob, require, section_of
from inflight.learn.replay import check_replay
from inflight.learn.tracking import REPORT_TO, check_installed
from inflight.models import checkpoint_fingerprint, resolve_model
from inflight.wire.contract import RunContract, SecretKnob, SharedKnobs
from inflight.wire.memory import trim_every_s
from learner.knobs import LossSettings, StepSettings

WILDCARD_HOSTS = ("0.0.0.0", "::", "*", "")  # --host values that bind every interface
ADVANTAGE_KINDS = ("mean", "std", "loo")  # --advantage; group_advantages checks against it too

# The train step's knobs, declared by the learner (learner/knobs.py): --loss is LossConfig's `kind`.
PolicyLossKnobs = section_of(
    "PolicyLossKnobs",
    "The policy loss (declared by learner/knobs.py:LossSettings, held by learner/losses.py:LossConfig).",
    LossSettings,
    {"loss": "kind", "tis_cap": "tis_cap", "aggregation": "aggregation"},
    __name__,
)
TrainStepKnobs = section_of(
    "TrainStepKnobs",
    "The optimizer step and the fused LM head + loss (declared by learner/knobs.py:StepSettings, held by "
    "learner/step.py:TrainConfig).",
    StepSettings,
    ("lr", "grad_clip", "fused_loss"),
    __name__,
)


@dataclass
class EndpointKnobs:
    """Where the learner listens for serves, and where it trains."""

    host: str = knob("127.0.0.1", "address to bind and to advertise to serves")
    rollouts_port: int = knob(5555, "PULL port serves push rollouts to")
    control_port: int = knob(5556, "ROUTER port serves connect their control DEALER to")
    weights_port: int = knob(5557, "TCPStore port of the weights group")
    backend: str = knob("gloo", "weights-group backend; nccl needs the learner on CUDA", choices=("gloo", "nccl"))
    device: str = knob(
        "auto",
        "where every rank trains (learner/world.py): cuda = cuda:LOCAL_RANK, NCCL between ranks, FSDP2 gathering the "
        "decoder layers in the --autocast dtype; cpu = gloo; auto = cuda where torch sees a GPU, else cpu",
        choices=("auto", "cpu", "cuda"),
    )


@dataclass
class LossKnobs(TrainStepKnobs, PolicyLossKnobs):  # type: ignore[misc,valid-type]
    """Which tokens train and how much: the staleness gates and the group advantage (the policy loss and the optimizer
    step it inherits have sections of their own)."""

    max_lag: int = knob(4, "the learner's staleness gate: tokens older than this many versions are masked")
    max_kv_lag: int = knob(
        -1,
        "KV staleness gate: tokens that attended to KV older than this many versions are masked (kv='keep' keeps a "
        "sequence's KV across commits); -1 = off",
    )
    advantage: str = knob("mean", "group advantage (inflight/learn/samples.py)", choices=ADVANTAGE_KINDS)

    def validate_loss(self) -> None:
        require(self.max_lag >= 0, "max_lag", self.max_lag, ">= 0")
        require(self.max_kv_lag >= -1, "max_kv_lag", self.max_kv_lag, ">= 0, or -1 = off")
        require(self.lr > 0, "lr", self.lr, "> 0")


@dataclass
class PrecisionKnobs:
    """The learner's parameter and compute dtypes."""

    dtype: str = knob("float32", "parameter dtype", choices=("float32", "bfloat16"))
    autocast: str = knob(
        "auto",
        "run the decoder under autocast in this dtype (the LM head, logprobs and optimizer stay in --dtype); auto = "
        "bfloat16 where the device computes it natively (CUDA; a CPU with AMX or avx512_bf16), none elsewhere (bf16 "
        "is ~50x slower than fp32 on an AVX2-only CPU)",
        choices=("auto", "none", "bfloat16"),
    )


@dataclass
class PublishKnobs:
    """How often and in what pieces the weights go to the serves."""

    publish_every: int = knob(1, "send weights every K steps")
    bucket_mb: int = knob(64, "weight bucket size in MiB")
    full_every: int = knob(
        1,
        "delta updates: N > 1 = a full update every N versions and between them only the elements that changed in "
        "the serves' dtype (a serve that joins or missed an update gets a full one); worth it where the weights "
        "cross a slow network. Costs each serve a copy of the weights in its dtype and device, the learner's rank 0 "
        "one in host memory, and both sides a compare per update. 1 = every update full (default)",
    )
    timeout_s: float = knob(60.0, "timeout of every weights-group collective")

    def validate_publish(self) -> None:
        require(self.publish_every >= 1, "publish_every", self.publish_every, ">= 1")
        require(self.bucket_mb >= 1, "bucket_mb", self.bucket_mb, ">= 1")
        require(self.full_every >= 1, "full_every", self.full_every, ">= 1 (1 = no delta updates)")
        trim_every_s()  # INFLIGHT_TRIM_EVERY_S: a bad value is refused here, not after the first update


@dataclass
class LoraKnobs:
    """LoRA training (learner/lora.py): adapters on the decoder's linear layers instead of every weight."""

    lora_dropout: float = knob(
        0.0,
        "LoRA dropout; must be 0: RL logprobs must be deterministic (the learner's logprob of a token must be the "
        "sampling policy's), and a dropout mask makes them random",
    )
    lora_merge_final: bool = knob(
        False, "with --lora-rank: also write the base model with the adapter merged in, <run_dir>/hf-final-merged"
    )

    def validate_lora(self) -> None:
        require(self.lora_dropout == 0, "lora_dropout", self.lora_dropout, "0 (RL logprobs must be deterministic)")
        require(
            self.lora_rank == 0 or self.full_every == 1,
            "full_every",
            self.full_every,
            "1 with --lora-rank (an adapter is a few MB: it is always sent whole, never as a delta)",
        )
        require(
            self.lora_rank > 0 or not self.lora_merge_final,
            "lora_merge_final",
            self.lora_merge_final,
            "false without --lora-rank (full fine-tuning's hf-final is already the whole model)",
        )


@dataclass
class RunDirKnobs:
    """How long the run goes, what it keeps in its directory, what it trains on and what it reports."""

    steps: int = knob(0, "stop after this many steps; 0 = until interrupted")
    run_dir: str = knob("runs/learn", "metrics, checkpoints and the resolved config go here")
    checkpoint_every: int = knob(0, "checkpoint every N steps; 0 = only at the end")
    keep_checkpoints: int = knob(2, "keep the N newest checkpoints; 0 = all")
    resume: bool = knob(False, "continue from the latest checkpoint in run_dir")
    wait_for_serves: int = knob(-1, "serves to wait for before the first step; -1 = 1, or 0 with --replay")
    replay: str = knob(
        "",
        "train on the rollouts of a recorded journal instead of serves: a run directory recorded with --keep-journal "
        "(or its journal/); no rollout socket is bound, serves may still join for the weights; the run stops when "
        "the journal's complete groups run out or at --steps",
    )
    keep_journal: bool = knob(
        False,
        "keep every journal segment (checkpoints delete none), so the run directory holds every rollout it trained "
        "on, for --replay; the journal then grows with the run",
    )
    seed: int = knob(0, "torch seed")
    report_to: str = knob(
        "none",
        "mirror every metrics.jsonl line, the serve's progress and sample completions to an experiment tracker "
        "(inflight/learn/tracking.py); wandb runs offline unless WANDB_MODE says otherwise",
        choices=REPORT_TO,
    )
    log_samples_every: int = knob(10, "with --report-to: a table of the step's completions every N steps; 0 = never")

    def validate_run_dir(self) -> None:
        require(self.steps >= 0, "steps", self.steps, ">= 0")
        require(self.keep_checkpoints >= 0, "keep_checkpoints", self.keep_checkpoints, ">= 0 (0 keeps all)")
        require(self.wait_for_serves >= -1, "wait_for_serves", self.wait_for_serves, ">= 0, or -1 = auto")
        if self.replay:
            check_replay(self.replay, self.run_dir)
        require(self.log_samples_every >= 0, "log_samples_every", self.log_samples_every, ">= 0 (0 = never)")
        check_installed(self.report_to)  # a missing package fails here, before a run starts anything

    def serves_to_wait_for(self) -> int:
        """`--wait-for-serves` resolved: -1 is 1 for a live run and 0 for a replay (no serve needed to train)."""
        if self.wait_for_serves >= 0:
            return self.wait_for_serves
        return 0 if self.replay else 1


@dataclass
class LearnConfig(
    RunDirKnobs, LoraKnobs, PublishKnobs, PrecisionKnobs, LossKnobs, EndpointKnobs, SecretKnob, SharedKnobs
):
    """The learner's knobs: the groups above (listed last to first, so `--help` starts with the shared ones)."""

    def validate(self) -> None:
        self.validate_shared()
        self.validate_loss()
        require(
            not (self.truncated and self.fused_loss == "on"),
            "fused_loss",
            self.fused_loss,
            "'auto' or 'off' with top-k/top-p/min-p sampling (the fused loss is full-softmax only)",
        )
        self.validate_publish()
        self.validate_lora()
        self.validate_run_dir()
        self.validate_secret()
        # A wildcard address listens on every interface, public ones included: only behind CURVE (docs/multi-node.md).
        require(
            self.host not in WILDCARD_HOSTS or bool(self.secret_file or self.socket_secret_file),
            "host",
            self.host,
            "a specific address (127.0.0.1, or this node's own address), or a wildcard together with --secret-file "
            "or --socket-secret-file",
        )

    def contract(self) -> RunContract:
        """What a serve must agree on (inflight/wire/contract.py); after `main` resolved `--autocast auto`. The compute
        dtype is the decoder's autocast dtype, or the parameter dtype without autocast; the head's is the parameter
        dtype (autocast never covers the LM head)."""
        base = checkpoint_fingerprint(resolve_model(self.model)) if self.lora_rank else ""
        return self.run_contract(self.dtype if self.autocast == "none" else self.autocast, self.dtype, base)
