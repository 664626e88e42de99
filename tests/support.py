"""Helpers shared by the real-engine tests: checkpoints to swap to, a rank-0 sender, greedy runs."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from serve_support import TEST_KV_GIB

from inflight.wire.group import GroupAddress, WeightsGroup, open_store
from inflight.wire.transfer import send_update
from inflight.wire.weights import UpdateManifest, plan_manifest, plan_update

# SmolLM2's greedy choice is clear on these (top-2 margin >= 0.5 nats): bf16 kernel differences do not flip it.
CONFIDENT_PROMPTS = ["What is 2 + 3? Reply with only the number.", "Count from 1 to 10."]
PROMPTS = [
    "What is 3 + 4? Reply with only the number.",
    "Name a colour.",
    "Count from one to five.",
    "Write a word that rhymes with cat.",
]


def load_state(model_dir: Path) -> dict[str, torch.Tensor]:
    state = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        state.update(load_file(f))
    return state


def perturbed_checkpoint(src: Path, dest: Path, seed: int, scale: float = 0.25) -> dict[str, torch.Tensor]:
    """Copy the HF directory `src` to `dest` with every tensor moved by `scale` × its own std: checkpoint "B"."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src, dest)
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, t in load_state(src).items():
        f = t.float()
        noise = torch.randn(f.shape, generator=gen) * (f.std() if f.numel() > 1 else 1.0) * scale
        state[name] = (f + noise).to(t.dtype).contiguous()
    save_file(state, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return state


class Sender:
    """The learner's rank 0, in a thread of the test process: hosts the store and broadcasts updates."""

    def __init__(self, world_size: int = 2, timeout_s: float = 20.0, bucket_bytes: int = 1 << 20):
        self.store = open_store(GroupAddress("127.0.0.1", 0, world_size, timeout_s=timeout_s), is_host=True)
        self.timeout_s, self.world_size, self.generation = timeout_s, world_size, 0
        self.bucket_bytes = bucket_bytes  # the tests' 1 MiB: many buckets from small models; a learner's is --bucket-mb
        self.group: WeightsGroup | None = None

    def address(self) -> GroupAddress:
        return GroupAddress(
            "127.0.0.1", self.store.port, self.world_size, f"w{self.generation}", "gloo", self.timeout_s
        )

    async def connect(self, engine, late_s: float = 0.0) -> list:
        """Form a fresh group with the engine's workers (ranks from 1 on), this rank joining `late_s` after them;
        returns each worker's `GroupJoined`."""
        self.generation += 1
        addr = self.address()

        def rank_0() -> WeightsGroup:
            time.sleep(late_s)
            return WeightsGroup(addr, 0, self.store)

        group_task = asyncio.to_thread(rank_0)
        join = engine.join_weights_group(addr.host, addr.port, 1, addr.world_size, group_name=addr.group_name,
                                         timeout_s=addr.timeout_s)  # fmt: skip
        self.group, joined = await asyncio.gather(group_task, join)
        return joined

    def manifest(self, state, version: int, bucket_bytes: int | None = None) -> UpdateManifest:
        return plan_manifest(state, version, bucket_bytes or self.bucket_bytes)

    def send_in_thread(self, manifest: UpdateManifest, state) -> tuple[threading.Thread, dict]:
        result: dict = {}

        def run():
            try:
                result["stats"] = send_update(self.group, manifest, state)
            except Exception as exc:
                result["error"] = exc

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread, result

    async def plan(self, state, version: int, **kw) -> tuple:
        """The update's manifest and payloads (push's `planned=`), planned on a thread (checksums of every tensor):
        on the event loop it held up the client's other requests, a cost of the test harness that benchmarks would
        book against the update."""
        return await asyncio.to_thread(plan_update, state, version, kw.get("bucket_bytes", self.bucket_bytes),
                                       base=kw.get("base"), keep_base=kw.get("keep_base", False),
                                       adapter=kw.get("adapter"))  # fmt: skip

    async def push(self, engine, state, version: int, mode: str = "never-stop", kv: str = "keep", **kw):
        """Send `state` as `version` and update the engine; `base=(version, tensors)` sends it as a delta on that
        version, `keep_base=True` asks the engine to keep it as the next delta's base, `adapter=AdapterSpec` sends
        `state` as that LoRA adapter's update; `planned=` what `plan` returned, planned ahead of a race."""
        manifest, payloads = kw.pop("planned", None) or await self.plan(state, version, **kw)
        for key in ("base", "keep_base", "adapter", "bucket_bytes"):
            kw.pop(key, None)
        thread, result = self.send_in_thread(manifest, payloads)
        report = await engine.update(manifest.encode(), mode=mode, kv=kv, **kw)
        await asyncio.to_thread(thread.join, self.timeout_s)
        if "error" in result:
            raise result["error"]
        return report


async def greedy(engine, tokenizer, prompts=PROMPTS, max_tokens: int = 16, tag: str = "g"):
    from vllm import SamplingParams

    # One request at a time: vLLM is not batch-invariant, so exact comparisons need identical batch shapes.
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [chat_ids(tokenizer, p) for p in prompts]
    return [await engine.generation.generate(i, params, f"{tag}-{k}") for k, i in enumerate(ids)]


def chat_ids(tokenizer, prompt: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False))  # fmt: skip


# The engine the in-process tests start, unless a test says otherwise: bf16 on every machine (the bit-for-bit
# comparisons run one computation on both engines, and bf16 is what a GPU serve runs), eager, the engine dtype's LM
# head, the prepared swap, no adapter, no routes. A serve's comes from its flags instead (inflight/serve/app.py).
TEST_ENGINE = {"dtype": "bfloat16", "enforce_eager": True, "head_dtype": "model", "update_memory": "double",
               "lora_rank": 0, "routing_replay": False, "kv_cache_gib": TEST_KV_GIB}  # fmt: skip


def as_float32(state: dict) -> dict:
    """A checkpoint's tensors as a float32 engine serves them (the learner sends the serve's dtype)."""
    return {name: t.float() if t.is_floating_point() else t for name, t in state.items()}


def start_engine(loop, model_dir, **overrides):
    from engine_processes import install

    from vllm_patches.engine import EngineConfig, InflightEngine

    install()  # EngineCore forked from a preloaded forkserver (tests/engine_processes.py)
    cfg = EngineConfig(model=str(model_dir), **{**TEST_ENGINE, **overrides})
    return loop.run_until_complete(InflightEngine.start(cfg))


def stop_engine(loop, engine) -> None:
    engine.shutdown()
    loop.run_until_complete(asyncio.sleep(0))


def held(loop, engine):
    """The first worker's `HeldWeights`: what it keeps of its live version (a delta's base, a rollback source)."""
    from vllm_patches.rpc import HeldWeights, rpc_result

    value = loop.run_until_complete(engine.llm.collective_rpc("inflight_held_weights"))[0]
    return rpc_result(value, HeldWeights, "inflight_held_weights")


def greedy_transformers(model, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Plain argmax decoding that, like vLLM with ignore_eos, keeps going through an end-of-turn token."""
    seq = ids
    for _ in range(n):
        nxt = model(seq).logits[0, -1].argmax()
        seq = torch.cat([seq, nxt.view(1, 1)], dim=1)
    return seq[0, ids.shape[1] :]
