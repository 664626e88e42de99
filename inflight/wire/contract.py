"""RunContract: what a serve and its learner must agree on, defined once, sent by the serve in `Hello`, checked there.

The learner's gradient is only the one its rollouts call for if both sides mean the same thing by a sample:

- `group_size`: advantages are baselined within a group (inflight/learn/samples.py), so a group of another size is
  another estimator (a smaller group, a noisier baseline), and the learner's groups per step were sized for its own.
- `temperature`: behaviour logprobs are after temperature; the learner computes its own at its `--temperature`, so
  every ratio against a rollout of another temperature is off from the first token.
- `top_p`, `top_k`, `min_p`: a truncated behaviour distribution is renormalised over the kept tokens; the learner
  computes its logprobs under the same rule (learner/truncation.py), so it must know the serve's: a learner computing
  another truncation (or a full softmax) biases every ratio by the log of a kept mass.
- `dtype`: the compute precision (the serve's engine dtype; the learner's autocast dtype, or its parameter dtype
  without autocast), always resolved (`auto` never travels: inflight/machine.py:resolve_precision runs first).
- `routing_replay`: a learner replaying MoE routes (learner/routing_replay.py) needs every rollout to carry them; a
  serve recording routes for a learner that ignores them spends its prefix cache for nothing.
- `lora_rank`, `lora_alpha`, `base_model` (issue 31): an adapter of another rank or scale is another policy, and an
  adapter trained on other base weights (an Instruct model's adapter on its base, say: the same tensor names and shapes)
  means nothing on them. `base_model` is a fingerprint of the checkpoint's contents (inflight/models.py:
  checkpoint_fingerprint), said only with an adapter. These are checked before the tensors, so the refusal names the
  flag, not the first adapter tensor that differs.

Advisory, not refused: `head_dtype`, the LM head's precision (the serve's `--head-dtype float32`, else its engine
dtype; the learner's parameter dtype — autocast never covers its head). Two heads of different precision only move the
lag-0 mismatch floor (3.6e-2 with a bf16 serve head against 1e-2 with an fp32 one on SmolLM2: BENCHMARKS.md), so the
learner warns (`RunContract.head_warning`) and goes on.

The learner (inflight/learn/membership.py:Membership.receive) refuses a serve whose contract differs, before any
weights move, naming the first differing field, both values and the flag that fixes it (`RunContract.mismatch`).

Not in it: the model (checked tensor by tensor against `Hello.tensors`), and knobs that only pace or bound generation
(groups per step, max tokens, update mode): they change how fast samples come, not what one means.

`SharedKnobs` declares, once, the flags of what both sides must be given alike (the model, the group size, the groups
per step, LoRA, routing replay, and the sampling knobs it inherits from `SamplingKnobs`); `SecretKnob` the shared
secret. ServeConfig, LearnConfig and RunConfig inherit them, so `--group-size`, `--top-k`, ... have one name, default
and help on every entry point. `SamplingKnobs` is also the learner's train step's own section (learner/step.py:
TrainConfig.sampling, whose truncation learner/truncation.py applies): `learner/` may import this package, so the
temperature and the truncation the learner computes its logprobs under are this one declaration too.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import msgspec

from inflight.config import knob, require
from inflight.wire.secure import read_secret

ADAPTER_FIELDS = ("lora_rank", "lora_alpha", "base_model")  # checked before the tensors (ServeCheck)
# The shared defaults: `SharedKnobs` and `RunContract` take theirs from here, so the flags and the wire agree.
GROUP_SIZE = 8
TEMPERATURE = 1.0
TOP_P = 1.0  # no nucleus truncation: the learner's logprobs are a full softmax
TOP_K = 0  # the one spelling of off, on every side and on the wire (vLLM's SamplingParams reads 0 as off too)
MIN_P = 0.0  # no min-p truncation
ROUTING_REPLAY = "off"  # MoE routing replay (issue 32): "on" | "off"
_TOLERANCE = 1e-6  # floats given as the same decimal on both sides compare equal; anything else differs


class RunContract(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What the serve samples with and the learner trains for; see the module docstring for why each field matters."""

    group_size: int = GROUP_SIZE
    temperature: float = TEMPERATURE
    top_p: float = TOP_P
    top_k: int = TOP_K
    min_p: float = MIN_P
    head_dtype: str = ""  # advisory: the LM head's precision ('' = not said); see the module docstring
    routing_replay: str = ROUTING_REPLAY
    dtype: str  # resolved compute dtype: 'float32', 'bfloat16' or 'float16'
    # LoRA (issue 31): the adapter's rank (0 = full weights) and its scale's numerator, resolved (0 -> the rank); an
    # adapter of another rank or scale is another policy. Its targets show in the adapter's tensor names (Hello).
    lora_rank: int = 0
    lora_alpha: float = 0.0
    base_model: str = ""  # with an adapter: the base checkpoint's fingerprint ('' = not said, not checked)

    def __post_init__(self) -> None:
        if self.dtype in ("", "auto", "none"):
            raise ValueError(
                f"RunContract.dtype is {self.dtype!r}: it carries the resolved compute dtype (resolve "
                "'auto' with inflight.machine.resolve_precision first)"
            )

    def mismatch(self, learner: RunContract, server_id: str, fields: tuple[str, ...] = ()) -> str:
        """'' when this serve's contract is the `learner`'s (in `fields`, default all), else the first differing field
        in words with its fix."""
        for name in fields or self.__struct_fields__:
            if name == "head_dtype":
                continue  # advisory: head_warning
            if name == "base_model" and not (self.base_model and learner.base_model):
                continue  # said only with an adapter
            mine, theirs = getattr(self, name), getattr(learner, name)
            numeric = isinstance(mine, float) or isinstance(theirs, float)
            same = abs(mine - theirs) <= _TOLERANCE if numeric else mine == theirs
            if not same:
                return f"serve {server_id}: {name} {mine}, but {_REASONS[name](theirs, mine)}"
        return ""

    def head_warning(self, learner: RunContract, server_id: str) -> str:
        """'' when both LM heads compute in the same precision (or either did not say), else a warning with the fix."""
        if not self.head_dtype or not learner.head_dtype or self.head_dtype == learner.head_dtype:
            return ""
        return (
            f"serve {server_id} computes its LM head in {self.head_dtype}, this learner in {learner.head_dtype}: "
            "the two heads' rounding adds to every lag-0 logprob mismatch; start the serve with --head-dtype "
            f"{'float32' if learner.head_dtype == 'float32' else 'model'}"
        )


def _dtype_reason(learner: str, serve: str) -> str:
    autocast = {"float32": "none", "bfloat16": "bfloat16"}.get(serve)  # the learner flag computing in the serve's dtype
    return (
        f"this learner computes in {learner}: updates below the coarser dtype's resolution are seen by one side "
        "only and the two policies drift apart (measured on SmolLM2: lag-0 mismatch 0.015 -> 0.56 in 16 steps of a "
        f"bf16 learner against an fp32 serve): start the serve with --dtype {learner}"
        + (f" or the learner with --autocast {autocast} (inflight.run --dtype sets both)" if autocast else "")
    )


# field -> (learner's value, serve's value) -> why it must agree and the flag that fixes it
_REASONS = {
    "group_size": lambda learner, serve: (
        f"this learner trains groups of {learner}: start both with the same --group-size"
    ),
    "temperature": lambda learner, serve: (
        f"this learner computes logprobs at temperature {learner}: start both with the same --temperature"
    ),
    "top_p": lambda learner, serve: (
        f"this learner computes logprobs under top_p {learner}: start both with the same --top-p"
    ),
    "top_k": lambda learner, serve: (
        f"this learner computes logprobs under top_k {learner} (0 = off): start both with the same --top-k"
    ),
    "min_p": lambda learner, serve: (
        f"this learner computes logprobs under min_p {learner}: start both with the same --min-p"
    ),
    "dtype": _dtype_reason,
    "lora_rank": lambda learner, serve: (
        f"this learner trains {'adapters of rank ' + str(learner) if learner else 'the full weights'}: start both "
        "with the same --lora-rank"
    ),
    "lora_alpha": lambda learner, serve: (
        f"this learner scales its adapters by {learner} / rank: start both with the same --lora-alpha"
    ),
    "base_model": lambda learner, serve: (
        f"this learner trains its adapter on another base model (checkpoint fingerprint {learner}): give both the "
        "same --model"
    ),
    "routing_replay": lambda learner, serve: (
        f"this learner runs with --routing-replay {learner}: start both with the same --routing-replay"
    ),
}


@dataclass
class SamplingKnobs:
    """The sampler's temperature and truncation, which the serve samples under and the learner computes its logprobs
    under. The learner's train step holds them as its own section (learner/step.py:TrainConfig.sampling)."""

    temperature: float = knob(
        TEMPERATURE,
        "sampling temperature: behaviour logprobs are after it and the learner "
        "computes its own at it; a serve of another is refused at Hello",
    )
    top_p: float = knob(
        TOP_P,
        "nucleus sampling, 1.0 = off; the learner computes its logprobs under the same "
        "truncation (learner/truncation.py); a serve of another is refused at Hello",
    )
    top_k: int = knob(TOP_K, "top-k sampling, 0 = off; both sides must have the same (refused at Hello)")
    min_p: float = knob(MIN_P, "min-p sampling, 0.0 = off; both sides must have the same (refused at Hello)")

    def validate_sampling(self) -> None:
        require(self.temperature > 0, "temperature", self.temperature, "> 0 (greedy has no behaviour distribution)")
        require(0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1], 1.0 = off")
        require(self.top_k != -1, "top_k", self.top_k, "0 for off (-1, vLLM's other spelling of off, is not used here)")
        require(self.top_k >= 0, "top_k", self.top_k, ">= 1, or 0 = off")
        require(0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1], 0.0 = off")

    def sampling_knobs(self) -> SamplingKnobs:
        """These knobs' values alone, for a config that holds them as a section (learner/step.py:TrainConfig)."""
        return SamplingKnobs(**{f.name: getattr(self, f.name) for f in fields(SamplingKnobs)})

    @property
    def truncated(self) -> bool:
        """Does the sampler drop tokens (top-k, top-p or min-p on)? Logprobs are then over the kept ones."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


@dataclass
class SharedKnobs(SamplingKnobs):
    """The flags a serve and its learner are given alike (`inflight.run` gives both the same value)."""

    model: str = knob(
        "smollm2",
        "prepared model name (inflight/models.py: smollm2, tiny-llama, ...) or HF dir; the "
        "serve and its learner load the same one",
    )
    group_size: int = knob(
        GROUP_SIZE,
        "completions sampled per prompt; the learner's advantages are baselined "
        "within a group: a serve of another size is refused at Hello",
    )
    groups_per_step: int = knob(4, "whole groups per learner step (the serve's admission window counts in steps)")
    lora_rank: int = knob(
        0,
        "train and serve LoRA adapters of this rank (the learner's base weights frozen, the serve's updates only the "
        "adapter, committed in flight into vLLM's adapter slot); 0 = full fine-tuning",
    )
    lora_alpha: float = knob(
        0.0,
        "LoRA scale numerator: the adapter adds (alpha / rank) * B @ A; 0 = the rank, so the scale is 1 and what is "
        "merged is W + B @ A (a scale that does not change with the rank; raise it to move faster at a given --lr)",
    )
    lora_targets: str = knob(
        "",
        "comma-separated linear modules of the decoder layers to adapt; empty = all of them (q_proj,k_proj,v_proj,"
        "o_proj,gate_proj,up_proj,down_proj for Llama/Qwen2; the attention's for Qwen3-MoE, whose experts are fused "
        "tensors, not linear modules); never the LM head or the embeddings",
    )
    routing_replay: str = knob(
        ROUTING_REPLAY,
        "MoE models (Qwen3-MoE, Qwen2-MoE, Mixtral): on = the serve records every token's top-k experts in every MoE "
        "layer into its rollouts (prefix caching off) and the learner routes each token to them; off = nothing "
        "recorded, no cost; both sides must have the same (refused at Hello)",
        choices=("on", "off"),
    )

    def validate_shared(self) -> None:
        require(self.group_size >= 1, "group_size", self.group_size, ">= 1")
        require(self.groups_per_step >= 1, "groups_per_step", self.groups_per_step, ">= 1")
        self.validate_sampling()
        require(self.lora_rank >= 0, "lora_rank", self.lora_rank, ">= 1, or 0 = full fine-tuning")
        require(self.lora_alpha >= 0, "lora_alpha", self.lora_alpha, "> 0, or 0 = the rank")

    @property
    def resolved_lora_alpha(self) -> float:
        """`--lora-alpha`, 0 meaning the rank (a scale of 1); 0 without an adapter."""
        return (self.lora_alpha or float(self.lora_rank)) if self.lora_rank else 0.0

    def lora_target_names(self) -> tuple[str, ...]:
        """`--lora-targets` as names (empty: all of the decoder's linear modules, resolved against the model)."""
        return tuple(name.strip() for name in self.lora_targets.split(",") if name.strip())

    def run_contract(self, dtype: str, head_dtype: str, base_model: str = "") -> RunContract:
        """This side's contract, with its resolved compute dtype, its LM head's precision and, with an adapter, its
        base checkpoint's fingerprint."""
        return RunContract(
            group_size=self.group_size,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            routing_replay=self.routing_replay,
            dtype=dtype,
            head_dtype=head_dtype,
            lora_rank=self.lora_rank,
            lora_alpha=self.resolved_lora_alpha,
            base_model=base_model if self.lora_rank else "",
        )


@dataclass
class SecretKnob:
    """The shared secret: the serve and the learner must be given the same file."""

    secret_file: str = knob(
        "",
        "shared secret (>= 16 bytes): ZeroMQ CURVE on the learner's rollout and control "
        "sockets (only serves given the same file connect) and keyed BLAKE2b tags on every "
        "weight update, verified by the serves; both sides must be given the same file",
    )

    socket_secret_file: str = knob(
        "",
        "shared secret (>= 16 bytes) for ZeroMQ CURVE on the rollout and control sockets only, "
        "without --secret-file's weight tags; --launcher ray makes one for every run unless "
        "--secret-file is given (which, when given, is used instead)",
    )

    def validate_secret(self) -> None:
        for flag, path in (("--secret-file", self.secret_file), ("--socket-secret-file", self.socket_secret_file)):
            if path:
                read_secret(path, flag)  # a missing or short file is refused at start, naming the flag

    def secrets(self) -> tuple[bytes | None, bytes | None]:
        """(the sockets' CURVE secret, the weight tags' secret): --secret-file is both; --socket-secret-file only the
        first, since keyed tags hash every update's bytes on the host (BENCHMARKS.md, "Authenticated updates")."""
        if self.secret_file:
            secret = read_secret(self.secret_file)
            return secret, secret
        return (read_secret(self.socket_secret_file, "--socket-secret-file") if self.socket_secret_file else None), None
