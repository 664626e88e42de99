"""The serve's LoRA adapter and its in-flight updates: staged off the engine thread, committed into vLLM's adapter slot
between two engine steps.

A serve started with `--lora-rank R` loads one adapter at start (`ServedAdapter`, a PEFT directory) under one LoRA id,
and every request of the run uses it (`lora_request`). An adapter update carries only the adapter's tensors, in PEFT's
names, checked against the served adapter's names, dtypes and shapes and its `AdapterSpec` before any bucket moves
(vllm_patches/worker_extension.py). The staging thread builds vLLM's `LoRAModel` from the verified tensors exactly as
vLLM's own loader does from a directory (`AdapterPreparer`: the same `from_lora_tensors` call, then the adapter
manager's packing of q/k/v and gate/up into the fused layers, with the scaling folded into B), so the commit only
copies each layer's A and B into the slot's stacked buffers (`AdapterSlot.commit`, what vLLM's `activate_adapter`
does, into the slot the adapter already holds): megabytes, not the model's weights. All-or-nothing: a failure part-way
copies the previous adapter back. The registered adapter is replaced too, so a later re-activation (after an eviction,
which a one-adapter serve never does) loads the new weights.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from inflight.machine import is_cuda
from inflight.wire.weights import AdapterSpec, ManifestError
from vllm_patches.device_plan import safetensors_header
from vllm_patches.routes import checkpoint_settings, has_experts
from vllm_patches.rpc import CommitApplied

ADAPTER_ID = 1  # the serve's one adapter: vLLM's lora_int_id of every request
ADAPTER_NAME = "inflight"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
# The ranks vLLM's engine accepts for max_lora_rank (vllm/config/lora.py:MaxLoRARanks).
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def engine_lora_rank(rank: int) -> int:
    """vLLM's `max_lora_rank` for an adapter of `rank`: the smallest it accepts that holds it."""
    fits = [r for r in VLLM_MAX_LORA_RANKS if r >= rank]
    if rank < 1 or not fits:
        raise ValueError(f"--lora-rank is {rank}: vLLM serves ranks 1 to {VLLM_MAX_LORA_RANKS[-1]}")
    return fits[0]


def check_lora_kernels(model: str, device: str) -> None:
    """Refuse an adapter on a MoE checkpoint off CUDA, before the engine starts. With LoRA enabled, vLLM 0.32 runs
    every MoE layer through its Triton LoRA experts kernel, whatever the adapter targets
    (vllm/model_executor/layers/fused_moe/oracle/unquantized.py: `is_lora_enabled`), and a CPU worker cannot run
    Triton: it would die at the first forward pass."""
    settings = checkpoint_settings(model)
    if settings is None or is_cuda(device) or not has_experts(settings):
        return
    raise ValueError(
        f"--lora-rank on {model} ({settings.get('model_type', 'a MoE model')}) needs a CUDA serve: with LoRA enabled "
        "vLLM runs the MoE layers through its Triton LoRA kernel, which a CPU serve cannot run. Serve it on a GPU "
        "(--serve-gpus), or train the whole model (--lora-rank 0)"
    )


@dataclass(frozen=True)
class ServedAdapter:
    """The adapter a serve loaded at start: its PEFT directory, shape and every tensor's (dtype, shape), read from the
    config and the safetensors header (no tensor data, no pickle)."""

    path: str
    spec: AdapterSpec
    expected: dict[str, tuple[str, list[int]]]
    config: dict[str, Any]

    @classmethod
    def read(cls, path: str | Path) -> ServedAdapter:
        directory = Path(path)
        config_file, weights_file = directory / ADAPTER_CONFIG, directory / ADAPTER_WEIGHTS
        if not config_file.is_file() or not weights_file.is_file():
            raise ValueError(f"--lora-init {directory}: a PEFT adapter needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
        config = json.loads(config_file.read_text())
        targets = config.get("target_modules")
        targets = sorted([targets] if isinstance(targets, str) else targets or [])
        spec = AdapterSpec(int(config["r"]), float(config["lora_alpha"]), targets)
        return cls(str(directory), spec, _header_layout(weights_file), config)


def _header_layout(weights_file: Path) -> dict[str, tuple[str, list[int]]]:
    layout = {}
    for name, entry in safetensors_header(weights_file).items():
        if entry["dtype"] not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{weights_file}: tensor {name} is {entry['dtype']}; an adapter is float32/bf16/fp16")
        layout[name] = (_SAFETENSORS_DTYPES[entry["dtype"]], [int(d) for d in entry["shape"]])
    return layout


def decoder_linear_targets(model_dir: str | Path) -> list[str]:
    """The module names (last component) of every 2-D weight inside the decoder layers (`*.layers.N.…`), from the
    checkpoint's headers: what `--lora-targets` empty means, as the learner resolves it (learner/lora.py: the decoder
    layers' nn.Linear modules). An MoE layer's experts and its router (`gate`) are left out: the learner's model holds
    them as fused expert tensors and a router module, not nn.Linear (transformers 5)."""
    names = set()
    for weights_file in sorted(Path(model_dir).glob("*.safetensors")):
        for name, shape in _base_layout(weights_file).items():
            module, _, leaf = name.rpartition(".")
            short = module.rpartition(".")[2]
            moe = ".experts." in f"{module}." or short == "gate"
            if leaf == "weight" and len(shape) == 2 and ".layers." in f".{module}" and not moe:
                names.add(short)
    return sorted(names)


def write_zero_adapter(model_dir: str | Path, dest: str | Path, spec: AdapterSpec) -> Path:
    """A PEFT adapter directory at `dest` for the checkpoint at `model_dir`: rank `spec.rank` on every 2-D weight of a
    module named in `spec.targets`, A and B zero — the base model's outputs, what a serve starts from before the
    learner's first update (PEFT's own start, random A and zero B, answers the same). Names and shapes from the
    checkpoint's safetensors headers, in PEFT's convention (`base_model.model.<module>.lora_A.weight`)."""
    layout = {}
    for weights_file in sorted(Path(model_dir).glob("*.safetensors")):
        layout.update(_base_layout(weights_file))
    tensors = {}
    for name, shape in sorted(layout.items()):
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or len(shape) != 2 or module.rpartition(".")[2] not in spec.targets:
            continue
        out, inp = shape
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.zeros(spec.rank, inp)
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.zeros(out, spec.rank)
    if not tensors:
        raise ValueError(f"--lora-targets {','.join(spec.targets)}: no 2-D weight of {model_dir} is in such a module")
    from safetensors.torch import save_file

    directory = Path(dest)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "target_modules": spec.targets,
        "bias": "none",
        "lora_dropout": 0.0,
        "base_model_name_or_path": str(model_dir),
    }
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=1))
    return directory


def _base_layout(weights_file: Path) -> dict[str, list[int]]:
    """Every tensor's shape in one safetensors file, from its header."""
    return {name: [int(d) for d in entry["shape"]] for name, entry in safetensors_header(weights_file).items()}


def lora_request(path: str):
    """The LoRA request every generation of a serve with an adapter carries."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(ADAPTER_NAME, ADAPTER_ID, str(path))


def check_adapter_update(spec: AdapterSpec | None, served: ServedAdapter | None) -> None:
    """Refuse an update whose kind or adapter shape does not match what this serve serves, naming what differs."""
    if served is None and spec is not None:
        raise ManifestError(
            f"an adapter update (rank {spec.rank}) reached a serve without an adapter: start the serve with "
            f"--lora-rank {spec.rank}, or train with --lora-rank 0"
        )
    if served is not None and spec is None:
        raise ManifestError(
            f"a full-weights update reached a serve of a rank-{served.spec.rank} adapter: the learner must train "
            f"with --lora-rank {served.spec.rank}, or the serve start with --lora-rank 0"
        )
    if served is not None and (differs := spec.differences(served.spec)):
        raise ManifestError(
            "the adapter update does not match the served adapter ("
            + "; ".join(differs)
            + "): give the learner and the serve the same --lora-rank, --lora-alpha and --lora-targets"
        )


@dataclass
class PreparedAdapter:
    """An adapter update built into vLLM's `LoRAModel` (host memory, as vLLM keeps adapters), ready to commit."""

    version: int
    lora: Any  # vllm.lora.lora_model.LoRAModel, packed for the fused layers
    # What the commit's stream must wait for on a GPU: nothing, the slot copies read host memory.
    layers: list = field(default_factory=list)


@dataclass(frozen=True)
class AdapterPreparer:
    """The staging thread's `prepare` for an adapter update (vllm_patches/staging.py:PrepareUpdate)."""

    slot: AdapterSlot
    version: int

    def __call__(self, tensors: dict[str, torch.Tensor], tail: object = None) -> PreparedAdapter:
        return PreparedAdapter(self.version, self.slot.build(tensors))  # a few MB: no arena tail (`tail` is None)


class AdapterSlot:
    """The worker's live adapter in vLLM's LoRA manager (`runner.lora_manager`): builds and commits updates."""

    def __init__(self, runner: Any, served: ServedAdapter):
        self.runner, self.served = runner, served
        self.current: Any = None  # the LoRAModel last committed; None: the adapter directory the serve started with
        self._serve_the_live_adapter()

    def _serve_the_live_adapter(self) -> None:
        """Make vLLM's worker LoRA manager load the live adapter, not the start directory's, whenever it (re)loads
        `ADAPTER_ID`: vLLM's `reset_lora_state` (after any `reload_weights`) and an LRU eviction drop the registered
        adapter, and the next request would bring the serve's *initial* adapter back from disk, silently serving a
        version the tokens are not tagged with."""
        workers = self.runner.lora_manager
        load_from_disk = workers._load_adapter

        def load_live(request: Any) -> Any:
            if request.lora_int_id == ADAPTER_ID and self.current is not None:
                return self.current
            return load_from_disk(request)

        workers._load_adapter = load_live

    @property
    def _manager(self) -> Any:
        return self.runner.lora_manager._adapter_manager

    def build(self, tensors: dict[str, torch.Tensor]) -> Any:
        """vLLM's `LoRAModel` of `tensors`, made as `WorkerLoRAManager._load_adapter` makes one from a directory."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        workers = self.runner.lora_manager
        config = {**self.served.config, "vllm_max_position_embeddings": workers.max_position_embeddings}
        helper = PEFTHelper.from_dict(config)
        helper.validate_legal(workers.lora_config)
        model = self._manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        lora = LoRAModel.from_lora_tensors(
            ADAPTER_ID,
            # copies: on CPU `.to` would hand vLLM the staged tensors themselves, views of the worker's arena, which the
            # next update overwrites while this LoRAModel is still the one vLLM reloads (`_serve_the_live_adapter`)
            {name: t.to("cpu", copy=True) for name, t in tensors.items()},
            helper,
            device="cpu",
            dtype=workers.lora_config.lora_dtype,
            model_vocab_size=workers.vocab_size,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None),
        )
        self._manager._create_merged_loras_inplace(lora)  # q/k/v → qkv_proj, gate/up → gate_up_proj; scaling into B
        return lora

    def commit(self, prepared: PreparedAdapter, version: int) -> tuple[CommitApplied, Callable[[], None]]:
        """Copy `prepared` into the adapter's slot, if it is active, and register it; all-or-nothing. Returns what was
        applied and what puts the previous adapter back (another tensor-parallel rank may fail its commit)."""
        start = time.perf_counter()
        manager = self._manager
        previous = manager._registered_adapters.get(ADAPTER_ID)
        try:
            self._into_slot(prepared.lora)
        except Exception:
            if previous is not None:
                self._into_slot(previous)
            raise
        manager._registered_adapters[ADAPTER_ID] = prepared.lora  # replaces in place: no eviction callback runs
        before, self.current = self.current, prepared.lora

        def roll_back() -> None:
            self.current = before
            if previous is not None:
                self._into_slot(previous)
                manager._registered_adapters[ADAPTER_ID] = previous

        return CommitApplied(version, time.perf_counter() - start), roll_back  # 0 swapped layers: copied in place

    def _into_slot(self, lora: Any) -> int:
        """Every LoRA layer's A and B into the slot `ADAPTER_ID` occupies (nothing when it is not active yet: the first
        request activates the registered adapter); how many layers were written."""
        manager = self._manager
        if ADAPTER_ID not in manager._active_adapters:
            return 0
        index = manager.lora_index_to_id.index(ADAPTER_ID)
        written = 0
        for name, module in manager.modules.items():
            weights = manager._get_lora_layer_weights(lora, name)
            if weights is None:
                module.reset_lora(index)
                continue
            module.set_lora(index, weights.lora_a, weights.lora_b)
            written += 1
        return written
