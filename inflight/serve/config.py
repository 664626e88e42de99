"""`ServeConfig`: every knob of `python -m inflight.serve`, with defaults that serve the embedded demo on CPU."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

from inflight.config import require
from inflight.wire.contract import GROUP_SIZE, MIN_P, TEMPERATURE, TOP_P, RunContract
from inflight.wire.weights import UPDATE_MEMORY

MODES = ("never-stop", "keep-pause", "drain", "abort-resume", "blocking")


def _h(text: str, **kw) -> dict:
    return {"help": text, **kw}


@dataclass
class ServeConfig:
    model: str = field(
        default="smollm2", metadata=_h("prepared model name (smollm2, tiny-llama, tiny-qwen2) or HF dir")
    )
    server_id: str = field(default="", metadata=_h("name (default <hostname>-<pid>); records say <name>@<run>"))
    rollouts: str = field(default="tcp://127.0.0.1:5555", metadata=_h("learner's rollout address (ZeroMQ PUSH to it)"))
    control: str = field(default="tcp://127.0.0.1:5556", metadata=_h("learner's control address (ZeroMQ DEALER)"))
    task: str = field(
        default="arithmetic",
        metadata=_h("'arithmetic', 'jsonl:<path>', 'parquet:<path>' or 'hf:<saved dir or dataset name>[@split]'"),
    )
    prompt_key: str = field(default="prompt", metadata=_h("column holding the prompt: a string or chat messages"))
    answer_key: str = field(default="answer", metadata=_h("column holding the reference answer; empty = none"))
    system_prompt: str = field(default="", metadata=_h("system message put before every prompt; empty = none"))
    task_seed: int = field(default=0, metadata=_h("seed of the prompt stream"))
    max_operand: int = field(default=20, metadata=_h("arithmetic difficulty: operands in [0, max_operand]"))
    arithmetic_terms: int = field(
        default=2, metadata=_h("arithmetic: operands per problem (3+ = multi-step, usual precedence)")
    )
    arithmetic_ops: str = field(default="+", metadata=_h("arithmetic: the operators drawn from, e.g. '+-*'"))
    reward: str = field(
        default="",
        metadata=_h(
            "rewards as module:function[,module:function...], f(text, problem) "
            "or TRL's f(prompts, completions, **columns); empty = the task's "
            "own"
        ),
    )
    reward_weights: str = field(default="", metadata=_h("one weight per --reward, comma-separated; empty = all 1.0"))
    reward_convention: str = field(
        default="auto",
        metadata=_h(
            "auto = by each reward's signature; sample = f(text, problem); group = TRL's per-group call",
            choices=("auto", "sample", "group"),
        ),
    )
    reward_constant_steps: int = field(
        default=10,
        metadata=_h("warn once when a reward is the same on every sample of this many steps in a row; 0 = never"),
    )
    eval_task: str = field(
        default="",
        metadata=_h(
            "held-out task scored between groups (as --task, e.g. hf:dir@test; same keys, rewards); empty = none"
        ),
    )
    eval_every: int = field(
        default=0,
        metadata=_h(
            "score --eval-task each time the served version reaches a multiple of this (learner versions); 0 = never"
        ),
    )
    eval_problems: int = field(default=64, metadata=_h("problems of --eval-task per eval (its first ones)"))
    eval_temperature: float = field(default=0.0, metadata=_h("eval sampling temperature; 0 = greedy"))
    group_size: int = field(
        default=GROUP_SIZE,
        metadata=_h("completions sampled per prompt (the learner's --group-size: another is refused)"),
    )
    max_inflight: int = field(default=64, metadata=_h("most requests generating at once"))
    max_tokens: int = field(default=48, metadata=_h("completion budget per sample"))
    temperature: float = field(
        default=TEMPERATURE,
        metadata=_h("sampling temperature (behaviour logprobs are after it; the learner's --temperature)"),
    )
    top_p: float = field(
        default=TOP_P,
        metadata=_h(
            "nucleus sampling, 1.0 = off (the learner's --top-p: it computes logprobs under the same truncation)"
        ),
    )
    top_k: int = field(default=-1, metadata=_h("top-k sampling, -1 = off (the learner's --top-k)"))
    min_p: float = field(default=MIN_P, metadata=_h("min-p sampling, 0.0 = off (the learner's --min-p)"))
    mode: str = field(default="never-stop", metadata=_h("how weight updates interrupt generation", choices=MODES))
    kv: str = field(default="keep", metadata=_h("KV cache after a commit", choices=("keep", "recompute")))
    max_outstanding: int = field(default=256, metadata=_h("most rollouts generating or waiting to be sent"))
    max_lag: int = field(
        default=1,
        metadata=_h(
            "admit a group only while admitted - consumed < (max_lag+1) * groups_per_step; -1 = no learner gate"
        ),
    )
    groups_per_step: int = field(default=4, metadata=_h("groups the learner trains on per step"))
    max_groups: int = field(default=0, metadata=_h("stop admitting after this many groups; 0 = endless"))
    env: str = field(
        default="single-turn",
        metadata=_h(
            "environment episodes run in: 'single-turn' (the task's "
            "prompt, one turn), 'calculator' (<calc> tool calls) or "
            "module:Class (inflight/envs/base.py)"
        ),
    )
    env_args: str = field(
        default="", metadata=_h("the environment's own keyword arguments as a JSON object, e.g. '{\"max_calls\": 4}'")
    )
    max_turns: int = field(default=4, metadata=_h("most policy turns per episode (--max-tokens is per turn)"))
    env_timeout_s: float = field(
        default=30.0,
        metadata=_h(
            "seconds one environment call (reset or step) may take before its episode ends as an environment error"
        ),
    )
    tool_latency: str = field(
        default="",
        metadata=_h(
            "simulated tool latency per sample: 'lognormal:MEDIAN_S,SIGMA' or 'pareto:SCALE_S,ALPHA'; empty = none"
        ),
    )
    http_port: int = field(default=0, metadata=_h("also answer vLLM's OpenAI API on this port; 0 = off"))
    http_host: str = field(default="127.0.0.1", metadata=_h("bind address of the OpenAI API"))
    metrics: str = field(default="", metadata=_h("append one JSON line of progress metrics per interval to this file"))
    progress_s: float = field(default=5.0, metadata=_h("seconds between progress lines"))
    max_model_len: int = field(default=1024, metadata=_h("engine context length"))
    max_num_seqs: int = field(default=256, metadata=_h("engine batch limit"))
    kv_cache_gib: float = field(
        default=1.0,
        metadata=_h(
            "CPU: KV cache size in GiB (fractions allowed); allocated "
            "and zeroed at start: a smaller one starts faster. Not used "
            "on CUDA (--gpu-memory-utilization)"
        ),
    )
    gpu_memory_utilization: float = field(
        default=0.9,
        metadata=_h(
            "CUDA: the fraction of the GPU's memory vLLM may "
            "take, in (0, 1] (weights, activations, CUDA "
            "graphs; the KV cache gets the rest); used there "
            "in place of --kv-cache-gib. Not used on "
            "CPU"
        ),
    )
    enforce_eager: bool = field(
        default=True,
        metadata=_h(
            "true = eager forward passes; false lets vLLM compile the "
            "model and capture CUDA graphs (faster decoding on GPU). "
            "Graphs hold parameter addresses, so false needs "
            "--update-memory low"
        ),
    )
    dtype: str = field(
        default="auto",
        metadata=_h(
            "engine dtype; auto = bfloat16 where the device computes it "
            "natively (CUDA; a CPU with AMX or avx512_bf16), float32 elsewhere "
            "(the learner's --autocast auto picks the same on the same kind of "
            "machine); float32 keeps behaviour logprobs within 1e-5 of an fp32 "
            "learner's",
            choices=("auto", "bfloat16", "float16", "float32"),
        ),
    )
    head_dtype: str = field(
        default="float32",
        metadata=_h(
            "LM head precision: float32 projects the last hidden "
            "state in fp32, as the learner's fp32 head does (the bf16 "
            "head's rounding was most of the bf16 lag-0 mismatch); "
            "model = the engine dtype. A no-op for a float32 engine",
            choices=("float32", "model"),
        ),
    )
    update_memory: str = field(
        default="double",
        metadata=_h(
            "double = each update is loaded and processed into a "
            "second copy of the weights off the engine thread and "
            "swapped in by reference (the commit stalls generation "
            "O(layers), not O(bytes); one extra copy of the weights "
            "while staged); low = copied into the live weights on "
            "the engine thread (no copy; keeps storage addresses, "
            "as CUDA graphs need)",
            choices=UPDATE_MEMORY,
        ),
    )
    seed: int = field(default=0, metadata=_h("engine sampling seed"))
    version: int = field(default=0, metadata=_h("weight version of the served checkpoint"))
    wait_for_learner: bool = field(
        default=True,
        metadata=_h(
            "admit nothing until the learner reports its latest "
            "published version, then until that version is committed "
            "here: a (re)started serve never generates with stale "
            "weights"
        ),
    )
    secret_file: str = field(
        default="",
        metadata=_h(
            "shared secret (>= 16 bytes): ZeroMQ CURVE on the learner's "
            "sockets and keyed BLAKE2b tags on every weight update; the "
            "learner must be given the same file"
        ),
    )

    def validate(self) -> None:
        require(self.group_size >= 1, "group_size", self.group_size, ">= 1")
        require(
            self.max_inflight >= self.group_size,
            "max_inflight",
            self.max_inflight,
            f">= group_size ({self.group_size})",
        )
        require(
            self.max_outstanding >= self.group_size,
            "max_outstanding",
            self.max_outstanding,
            f">= group_size ({self.group_size})",
        )
        require(self.max_tokens >= 1, "max_tokens", self.max_tokens, ">= 1")
        require(self.temperature > 0, "temperature", self.temperature, "> 0 (greedy has no behaviour distribution)")
        require(0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1], 1.0 = off")
        require(self.top_k >= -1, "top_k", self.top_k, ">= 1, or -1 / 0 = off")
        require(0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1], 0.0 = off")
        require(self.max_lag >= -1, "max_lag", self.max_lag, ">= -1")
        require(self.groups_per_step >= 1, "groups_per_step", self.groups_per_step, ">= 1")
        require(0 <= self.http_port < 65536, "http_port", self.http_port, "0 (off) or a TCP port")
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
        require(self.max_turns >= 1, "max_turns", self.max_turns, ">= 1")
        require(self.env_timeout_s > 0, "env_timeout_s", self.env_timeout_s, "> 0 seconds")
        require(self.arithmetic_terms >= 2, "arithmetic_terms", self.arithmetic_terms, ">= 2")
        require(
            bool(self.arithmetic_ops) and set(self.arithmetic_ops) <= set("+-*"),
            "arithmetic_ops",
            self.arithmetic_ops,
            "one or more of '+', '-', '*', e.g. '+-*'",
        )
        from inflight.envs.loading import load_env

        load_env(self.env, self.env_args)  # a bad --env or --env-args is refused before the engine starts
        require(self.kv_cache_gib > 0, "kv_cache_gib", self.kv_cache_gib, "> 0 GiB (fractions allowed, e.g. 0.25)")
        require(
            0 < self.gpu_memory_utilization <= 1,
            "gpu_memory_utilization",
            self.gpu_memory_utilization,
            "in (0, 1]: the fraction of the GPU's memory vLLM may take, e.g. 0.9",
        )
        from vllm_patches.engine import check_graph_safe_updates

        check_graph_safe_updates(self.enforce_eager, self.update_memory)
        from inflight.wire.memory import trim_every_s

        trim_every_s()  # INFLIGHT_TRIM_EVERY_S: a bad value is refused here, not after the first update
        if self.secret_file:
            from inflight.wire.secure import read_secret

            read_secret(self.secret_file)
        if self.tool_latency:
            from inflight.serve.latency import parse_latency

            parse_latency(self.tool_latency)

    def contract(self) -> RunContract:
        """What this serve samples with, for `Hello` (inflight/wire/contract.py); once `main` resolved `--dtype`."""
        # vLLM reads top_k -1 and 0 both as off; the contract holds 0
        return RunContract(
            group_size=self.group_size,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            min_p=self.min_p,
            dtype=self.dtype,
            head_dtype="float32" if self.head_dtype == "float32" else self.dtype,
        )

    def memory_sizing(self, device: str) -> str:
        """Which flag sizes the engine's memory on `device`, in words for the start-up log."""
        from inflight.machine import is_cuda

        if is_cuda(device):
            return f"--gpu-memory-utilization {self.gpu_memory_utilization} (--kv-cache-gib is not used on CUDA)"
        return f"--kv-cache-gib {self.kv_cache_gib} (--gpu-memory-utilization is not used on CPU)"

    def resolved_server_id(self) -> str:
        return self.server_id or f"{socket.gethostname()}-{os.getpid()}"
