"""Helpers shared by the real-engine tests: checkpoints to swap to, a rank-0 sender, greedy runs, and the session's
pool of in-process engines (`EnginePool`, served by tests/conftest.py:engine_pool). Runs in the pytest process."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import threading
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

    def __init__(self, world_size: int = 2, timeout_s: float = 20.0):
        self.store = open_store(GroupAddress("127.0.0.1", 0, world_size, timeout_s=timeout_s), is_host=True)
        self.timeout_s, self.world_size, self.generation = timeout_s, world_size, 0
        self.group: WeightsGroup | None = None

    def address(self) -> GroupAddress:
        return GroupAddress(
            "127.0.0.1", self.store.port, self.world_size, f"w{self.generation}", "gloo", self.timeout_s
        )

    async def connect(self, engine) -> list:
        """Form a fresh group with the engine's workers (ranks from 1 on); returns each worker's `GroupJoined`."""
        self.generation += 1
        addr = self.address()
        group_task = asyncio.to_thread(WeightsGroup, addr, 0, self.store)
        join = engine.join_weights_group(addr.host, addr.port, 1, addr.world_size, group_name=addr.group_name,
                                         timeout_s=addr.timeout_s)  # fmt: skip
        self.group, joined = await asyncio.gather(group_task, join)
        return joined

    def manifest(self, state, version: int, bucket_bytes: int = 1 << 20) -> UpdateManifest:
        return plan_manifest(state, version, bucket_bytes)

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

    async def push(self, engine, state, version: int, mode: str = "never-stop", kv: str = "keep", **kw):
        """Send `state` as `version` and update the engine; `base=(version, tensors)` sends it as a delta on that
        version, `keep_base=True` asks the engine to keep it as the next delta's base, `adapter=AdapterSpec` sends
        `state` as that LoRA adapter's update."""
        base, keep, adapter = kw.pop("base", None), kw.pop("keep_base", False), kw.pop("adapter", None)
        # Planned on a thread (checksums of every tensor): on the event loop it held up the client's other requests,
        # a cost of the test harness that benchmarks would book against the update.
        manifest, payloads = await asyncio.to_thread(plan_update, state, version, kw.pop("bucket_bytes", 1 << 20),
                                                     base=base, keep_base=keep, adapter=adapter)  # fmt: skip
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


def start_engine(loop, model_dir, **overrides):
    from vllm_patches.engine import EngineConfig, InflightEngine

    cfg = EngineConfig(model=str(model_dir), **{"kv_cache_gib": TEST_KV_GIB, **overrides})
    return loop.run_until_complete(InflightEngine.start(cfg))


def stop_engine(loop, engine) -> None:
    engine.shutdown()
    loop.run_until_complete(asyncio.sleep(0))


def greedy_transformers(model, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Plain argmax decoding that, like vLLM with ignore_eos, keeps going through an end-of-turn token."""
    seq = ids
    for _ in range(n):
        nxt = model(seq).logits[0, -1].argmax()
        seq = torch.cat([seq, nxt.view(1, 1)], dim=1)
    return seq[0, ids.shape[1] :]


class PooledEngine:
    """One pool engine: its key, the fresh engine's greedy reference on `PROMPTS`, the version it was given back at."""

    def __init__(self, key: tuple, engine, tokenizer, reference: list):
        self.key, self.engine, self.tokenizer, self.reference = key, engine, tokenizer, reference
        self.version = engine.version

    @property
    def model_dir(self) -> str:
        return self.key[0]

    @property
    def overrides(self) -> dict:
        return dict(self.key[1])


class EnginePool:
    """The session's in-process engines, keyed by (model, engine config), so that test modules asking for the same
    engine share one start (tests/conftest.py:engine_pool; the count is in the README's Tests section).

    Hygiene, so that sharing cannot make a test pass wrongly: each engine's greedy tokens and sampled-token logprobs on
    `PROMPTS` are recorded when it starts (the fresh engine's reference); a user that moved the version gets the
    checkpoint's weights pushed back when it gives the engine back; and every checkout compares the engine's outputs
    with the fresh reference bit for bit, and its version with the one it was given back at, failing loudly if either
    differs. What cannot be undone (a weights key) is given back with `keep=False`: the engine is stopped; so is an
    engine no later module shares (`keep=False` too), so that it does not push a shared one out. At most `size` idle
    engines stay alive, the least recently given back stopped first (tiny models, ~1 GB each; 24 GiB, shared)."""

    def __init__(self, loop, size: int = 3):
        self.loop, self.size, self.checks = loop, size, 0
        self.idle: dict[tuple, PooledEngine] = {}  # insertion order: least recently given back first
        self._known: list[PooledEngine] = []  # checked out now

    @contextlib.contextmanager
    def engine(self, model_dir, keep: bool = True, **overrides):
        """A started engine for `model_dir` with `overrides` (start_engine's), back at the checkpoint's weights."""
        pooled = self.checkout(pool_key(model_dir, overrides))
        try:
            yield pooled.engine
        finally:
            self.give_back(pooled, keep)

    def checkout(self, key: tuple) -> PooledEngine:
        pooled = self.idle.pop(key, None)
        if pooled is None:
            pooled = self._start(key)
        elif pooled.engine.version != pooled.version:
            self._stop(pooled)  # a dirty engine is never handed out, nor left running
            raise AssertionError(
                f"pool engine {key} was given back at version {pooled.version} and is now at "
                f"{pooled.engine.version}: something used it while it was idle"
            )
        else:
            self._check(pooled, "on checkout")
        self._known.append(pooled)
        return pooled

    def give_back(self, pooled: PooledEngine, keep: bool) -> None:
        self._known.remove(pooled)
        if not keep:
            self._stop(pooled)
            return
        if self._outputs(pooled) != _fingerprint(pooled.reference):
            self._restore(pooled)
            self._check(pooled, "after pushing the checkpoint back")
        pooled.version = pooled.engine.version
        self.idle[pooled.key] = pooled
        while len(self.idle) > self.size:
            self._stop(self.idle.pop(next(iter(self.idle))))

    def close(self) -> None:
        for pooled in [*self.idle.values(), *self._known]:
            self._stop(pooled)
        self.idle.clear()

    def _start(self, key: tuple) -> PooledEngine:
        from transformers import AutoTokenizer

        engine = start_engine(self.loop, key[0], **dict(key[1]))
        tokenizer = AutoTokenizer.from_pretrained(key[0])
        return PooledEngine(key, engine, tokenizer, self.loop.run_until_complete(greedy(engine, tokenizer, tag="ref")))

    def _outputs(self, pooled: PooledEngine) -> list:
        self.checks += 1
        got = self.loop.run_until_complete(greedy(pooled.engine, pooled.tokenizer, tag=f"pool-check-{self.checks}"))
        assert all(set(g.versions) == {pooled.engine.version} for g in got), "pool check: tokens of another version"
        return _fingerprint(got)

    def _check(self, pooled: PooledEngine, when: str) -> None:
        if self._outputs(pooled) != _fingerprint(pooled.reference):
            self._stop(pooled)
            raise AssertionError(f"pool engine {pooled.key} {when}: its greedy outputs differ from the fresh engine's")

    def _restore(self, pooled: PooledEngine) -> None:
        """Push the checkpoint's own weights (in the engine's dtype, as the tests send them) as the next version."""
        state = load_state(Path(pooled.model_dir))
        if pooled.overrides.get("dtype") == "float32":
            state = {n: t.float() if t.is_floating_point() else t for n, t in state.items()}
        sender = Sender(world_size=1 + pooled.overrides.get("tensor_parallel_size", 1))
        self.loop.run_until_complete(sender.connect(pooled.engine))  # replaces the last user's group in the workers
        self.loop.run_until_complete(sender.push(pooled.engine, state, pooled.engine.version + 1))

    def _stop(self, pooled: PooledEngine) -> None:
        stop_engine(self.loop, pooled.engine)


def pool_key(model_dir, overrides: dict) -> tuple:
    """(model, the overrides that differ from start_engine's defaults): `update_memory="double"` is no override."""
    from vllm_patches.engine import EngineConfig

    defaults = {**vars(EngineConfig(model=str(model_dir))), "kv_cache_gib": TEST_KV_GIB}
    return str(model_dir), tuple(sorted((k, v) for k, v in overrides.items() if defaults[k] != v))


def _fingerprint(completions: list) -> list:
    """What must be bit for bit a fresh engine's: each prompt's greedy tokens and their sampled-token logprobs."""
    return [(list(c.token_ids), list(c.logprobs)) for c in completions]
