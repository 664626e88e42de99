"""`LearnConfig`: every knob of `python -m inflight.learn`, with defaults that train the embedded demo on CPU."""

from __future__ import annotations

from dataclasses import dataclass, field

from inflight.config import require
from inflight.learn.tracking import REPORT_TO, check_installed
from inflight.wire.contract import GROUP_SIZE, MIN_P, TEMPERATURE, TOP_K, TOP_P, RunContract


def _h(text: str, **kw) -> dict:
    return {"help": text, **kw}


@dataclass
class LearnConfig:
    model: str = field(default="smollm2", metadata=_h("prepared model name or HF dir (the same one serve loads)"))
    host: str = field(default="127.0.0.1", metadata=_h("address to bind and to advertise to serves"))
    rollouts_port: int = field(default=5555, metadata=_h("PULL port serves push rollouts to"))
    control_port: int = field(default=5556, metadata=_h("ROUTER port serves connect their control DEALER to"))
    weights_port: int = field(default=5557, metadata=_h("TCPStore port of the weights group"))
    backend: str = field(
        default="gloo", metadata=_h("weights-group backend; nccl needs the learner on CUDA", choices=("gloo", "nccl"))
    )
    device: str = field(
        default="auto",
        metadata=_h(
            "where every rank trains (learner/world.py): cuda = "
            "cuda:LOCAL_RANK, NCCL between ranks, FSDP2 gathering the decoder "
            "layers in the --autocast dtype; cpu = gloo; auto = cuda where "
            "torch sees a GPU, else cpu",
            choices=("auto", "cpu", "cuda"),
        ),
    )
    groups_per_step: int = field(default=4, metadata=_h("whole groups per optimizer step"))
    group_size: int = field(
        default=GROUP_SIZE,
        metadata=_h("completions per prompt the serves sample: a serve of another --group-size is refused at Hello"),
    )
    steps: int = field(default=0, metadata=_h("stop after this many steps; 0 = until interrupted"))
    max_lag: int = field(default=4, metadata=_h("staleness gate: tokens older than this many versions are masked"))
    max_kv_lag: int = field(
        default=-1,
        metadata=_h(
            "KV staleness gate: tokens that attended to KV older than this "
            "many versions are masked (kv='keep' keeps a sequence's KV across "
            "commits); -1 = off"
        ),
    )
    loss: str = field(default="tis", metadata=_h("policy loss", choices=("tis", "ppo", "mask")))
    aggregation: str = field(default="token", metadata=_h("loss aggregation", choices=("token", "sequence")))
    advantage: str = field(default="mean", metadata=_h("group advantage", choices=("mean", "std", "loo")))
    tis_cap: float = field(default=2.0, metadata=_h("tis: cap on the importance ratio"))
    temperature: float = field(
        default=TEMPERATURE,
        metadata=_h(
            "sampling temperature of the serves: learner logprobs are "
            "computed at it; a serve of another is refused at Hello"
        ),
    )
    top_p: float = field(
        default=TOP_P,
        metadata=_h(
            "the serves' top-p: logprobs under the same nucleus truncation "
            "(learner/truncation.py); a serve of another is refused at Hello"
        ),
    )
    top_k: int = field(default=TOP_K, metadata=_h("the serves' top-k, 0 or -1 = off; another is refused at Hello"))
    min_p: float = field(default=MIN_P, metadata=_h("the serves' min-p, 0.0 = off; another is refused at Hello"))
    lr: float = field(default=1e-5, metadata=_h("AdamW learning rate"))
    grad_clip: float = field(default=1.0, metadata=_h("max gradient norm"))
    dtype: str = field(default="float32", metadata=_h("parameter dtype", choices=("float32", "bfloat16")))
    autocast: str = field(
        default="auto",
        metadata=_h(
            "run the decoder under autocast in this dtype (the LM head, "
            "logprobs and optimizer stay in --dtype); auto = bfloat16 where "
            "the device computes it natively (CUDA; a CPU with AMX or "
            "avx512_bf16), none elsewhere (bf16 is ~50x slower than fp32 on "
            "an AVX2-only CPU)",
            choices=("auto", "none", "bfloat16"),
        ),
    )
    fused_loss: str = field(
        default="auto",
        metadata=_h(
            "LM head + policy loss in one pass (learner/fused_loss.py): "
            "auto = on CUDA with Triton; on = also elsewhere (torch); "
            "off",
            choices=("auto", "on", "off"),
        ),
    )
    publish_every: int = field(default=1, metadata=_h("send weights every K steps"))
    bucket_mb: int = field(default=64, metadata=_h("weight bucket size in MiB"))
    full_every: int = field(
        default=1,
        metadata=_h(
            "delta updates: N > 1 = a full update every N versions and "
            "between them only the elements that changed in the serves' dtype "
            "(a serve that joins or missed an update gets a full one); worth it "
            "where the weights cross a slow network. Costs each serve a copy "
            "of the weights in its dtype and device, and both sides a compare "
            "per update. 1 = every update full (default)"
        ),
    )
    timeout_s: float = field(default=60.0, metadata=_h("timeout of every weights-group collective"))
    run_dir: str = field(default="runs/learn", metadata=_h("metrics, checkpoints and the resolved config go here"))
    checkpoint_every: int = field(default=0, metadata=_h("checkpoint every N steps; 0 = only at the end"))
    keep_checkpoints: int = field(default=2, metadata=_h("keep the N newest checkpoints; 0 = all"))
    resume: bool = field(default=False, metadata=_h("continue from the latest checkpoint in run_dir"))
    wait_for_serves: int = field(
        default=-1, metadata=_h("serves to wait for before the first step; -1 = 1, or 0 with --replay")
    )
    replay: str = field(
        default="",
        metadata=_h(
            "train on the rollouts of a recorded journal instead of serves: a run "
            "directory recorded with --keep-journal (or its journal/); no "
            "rollout socket is bound, serves may still join for the weights; "
            "the run stops when the journal's complete groups run out or at "
            "--steps"
        ),
    )
    keep_journal: bool = field(
        default=False,
        metadata=_h(
            "keep every journal segment (checkpoints delete none), so "
            "the run directory holds every rollout it trained on, for "
            "--replay; the journal then grows with the run"
        ),
    )
    seed: int = field(default=0, metadata=_h("torch seed"))
    report_to: str = field(
        default="none",
        metadata=_h(
            "mirror every metrics.jsonl line, the serve's progress and "
            "sample completions to an experiment tracker (inflight/learn/"
            "tracking.py); wandb runs offline unless WANDB_MODE says "
            "otherwise",
            choices=REPORT_TO,
        ),
    )
    log_samples_every: int = field(
        default=10, metadata=_h("with --report-to: a table of the step's completions every N steps; 0 = never")
    )
    secret_file: str = field(
        default="",
        metadata=_h(
            "shared secret (>= 16 bytes): the rollout and control sockets admit only serves given the same file"
            " (ZeroMQ CURVE), and every weight update carries keyed BLAKE2b tags those serves verify"
        ),
    )

    def validate(self) -> None:
        require(self.groups_per_step >= 1, "groups_per_step", self.groups_per_step, ">= 1")
        require(self.group_size >= 1, "group_size", self.group_size, ">= 1")
        require(self.max_lag >= 0, "max_lag", self.max_lag, ">= 0")
        require(self.max_kv_lag >= -1, "max_kv_lag", self.max_kv_lag, ">= 0, or -1 = off")
        require(self.publish_every >= 1, "publish_every", self.publish_every, ">= 1")
        require(self.bucket_mb >= 1, "bucket_mb", self.bucket_mb, ">= 1")
        require(self.full_every >= 1, "full_every", self.full_every, ">= 1 (1 = no delta updates)")
        require(self.lr > 0, "lr", self.lr, "> 0")
        require(self.temperature > 0, "temperature", self.temperature, "> 0")
        require(0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1], 1.0 = off")
        require(self.top_k >= -1, "top_k", self.top_k, ">= 1, or 0 / -1 = off")
        require(0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1], 0.0 = off")
        truncated = self.top_p < 1 or self.top_k > 0 or self.min_p > 0
        require(
            not (truncated and self.fused_loss == "on"),
            "fused_loss",
            self.fused_loss,
            "'auto' or 'off' with top-k/top-p/min-p sampling (the fused loss is full-softmax only)",
        )
        require(self.steps >= 0, "steps", self.steps, ">= 0")
        require(self.keep_checkpoints >= 0, "keep_checkpoints", self.keep_checkpoints, ">= 0 (0 keeps all)")
        require(self.wait_for_serves >= -1, "wait_for_serves", self.wait_for_serves, ">= 0, or -1 = auto")
        if self.replay:
            from inflight.learn.replay import check_replay

            check_replay(self.replay, self.run_dir)
        from inflight.wire.memory import trim_every_s

        trim_every_s()  # INFLIGHT_TRIM_EVERY_S: a bad value is refused here, not after the first update
        require(self.log_samples_every >= 0, "log_samples_every", self.log_samples_every, ">= 0 (0 = never)")
        check_installed(self.report_to)  # a missing package fails here, before a run starts anything
        if self.secret_file:
            from inflight.wire.secure import read_secret

            read_secret(self.secret_file)

    def serves_to_wait_for(self) -> int:
        """`--wait-for-serves` resolved: -1 is 1 for a live run and 0 for a replay (no serve needed to train)."""
        if self.wait_for_serves >= 0:
            return self.wait_for_serves
        return 0 if self.replay else 1

    def contract(self) -> RunContract:
        """What a serve must agree on (inflight/wire/contract.py); after `main` resolved `--autocast auto`. The compute
        dtype is the decoder's autocast dtype, or the parameter dtype without autocast."""
        dtype = self.dtype if self.autocast == "none" else self.autocast
        return RunContract(
            group_size=self.group_size,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            min_p=self.min_p,
            dtype=dtype,
            head_dtype=self.dtype,
        )  # the parameter dtype: autocast never covers the LM head
