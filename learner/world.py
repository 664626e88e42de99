"""World: where every learner rank runs — device, ranks, FSDP mesh, default group, weights-group backend.

Built once per process by `start_world` from torchrun's environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`) and the
learner's `--device auto|cpu|cuda`, then handed to everything that places a tensor: the model load, the batches of
the train step, the per-step sample broadcast and the weight publisher. Nothing below it names a device, so a CPU
learner and a CUDA learner run the same code (torchtitan's `ParallelDims` plays this part there).

On CUDA each rank owns `cuda:LOCAL_RANK`, the default group is NCCL and FSDP2 runs the decoder layers in the compute
dtype (`MixedPrecisionPolicy`: bf16 compute, fp32 master weights and gradient reductions) while the root — embeddings,
final norm, LM head — keeps the parameter dtype, as the logprobs feed importance ratios. On CPU the default group is
gloo and the decoder's precision is left to autocast, exactly as before this object existed.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

DEVICES = ("auto", "cpu", "cuda")
WEIGHTS_BACKENDS = ("gloo", "nccl")


class WorldError(RuntimeError):
    """The learner cannot run where it was asked to; the message names the flag and the fix."""


@dataclass(frozen=True)
class World:
    """One learner rank's placement. `mesh` is the 1-D FSDP mesh over every rank (None in a world of one, which is
    not sharded); `weights_backend` is the weights group's backend (gloo or NCCL, inflight/wire/group.py), which fixes
    where the published tensors must be (`weights_device`)."""

    device_type: str  # "cpu" or "cuda"
    rank: int = 0
    local_rank: int = 0
    size: int = 1
    weights_backend: str = "gloo"
    mesh: DeviceMesh | None = None

    @property
    def device(self) -> torch.device:
        """This rank's device: `cuda:LOCAL_RANK`, or the CPU."""
        return torch.device("cuda", self.local_rank) if self.device_type == "cuda" else torch.device("cpu")

    @property
    def backend(self) -> str:
        """The default group's backend: NCCL between GPUs, gloo between CPU processes."""
        return default_backend(self.device_type)

    @property
    def weights_device(self) -> torch.device:
        """Where published buckets must live: NCCL moves device memory only, gloo host memory."""
        return self.device if self.weights_backend == "nccl" else torch.device("cpu")

    def layer_compute_dtype(self, autocast: torch.dtype | None) -> torch.dtype | None:
        """The dtype FSDP2 gathers and runs the decoder layers in (`shard_policy`'s `compute_dtype`): the autocast
        dtype on CUDA, None (parameters as they are, autocast alone) on CPU, where existing runs stay bit-identical."""
        return autocast if self.device_type == "cuda" else None

    def close(self, clean: bool) -> None:
        """Leave the torch world: every rank meets at a barrier (after a clean run), then the group is torn down.

        Without the barrier, a rank that finishes first (rank 1 returns from the HF export while rank 0 still writes
        files) exits with gloo's threads alive and the C++ runtime aborts it ("terminate called without an active
        exception", SIGABRT). FSDP state holds reference cycles: collected before the group goes, since one freed at
        interpreter exit, after it, aborted a rank the same way (tests/learner/spawn_support.py does the same)."""
        if not dist.is_initialized():
            return
        if clean and dist.get_world_size() > 1:
            dist.barrier()
        gc.collect()
        dist.destroy_process_group()


def default_backend(device_type: str) -> str:
    """The default group's backend for `device_type`."""
    return "nccl" if device_type == "cuda" else "gloo"


def resolve_device(device: str) -> str:
    """`--device` as 'cpu' or 'cuda': auto = cuda where torch sees a GPU, else cpu. 'cuda' without one raises
    WorldError naming the flag and the fix, before any model or socket is touched."""
    if device not in DEVICES:
        raise WorldError(f"--device is {device!r}, expected one of {', '.join(DEVICES)}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        build = f"torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}"
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f", CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
        raise WorldError(
            f"--device is 'cuda', but torch sees no CUDA device ({build}{where}): pass --device cpu "
            "(or auto), or run on a GPU machine with a CUDA build of torch"
        )
    return device


def start_world(device: str = "auto", weights_backend: str = "gloo") -> World:
    """This process's World: resolves `device`, joins torchrun's world when launched by torchrun (NCCL on CUDA, gloo
    on CPU; a world of one otherwise) and builds the FSDP mesh. Call once per process, before the model is loaded;
    `World.close` at the end. Raises WorldError for a placement that cannot work (no GPU, too few GPUs for the local
    ranks, NCCL weights from a CPU learner)."""
    device_type = resolve_device(device)
    if weights_backend not in WEIGHTS_BACKENDS:
        raise WorldError(f"--backend is {weights_backend!r}, expected one of {', '.join(WEIGHTS_BACKENDS)}")
    if weights_backend == "nccl" and device_type != "cuda":
        raise WorldError(
            "--backend is 'nccl', but the learner runs on the CPU (--device " + device + "): NCCL moves "
            "GPU memory only; pass --backend gloo, or --device cuda on a GPU machine"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        _use_gpu(local_rank)
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        dist.init_process_group(default_backend(device_type))
    rank, size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mesh = None
    if size > 1:
        mesh = init_device_mesh(device_type, (size,))
    return World(device_type, rank, local_rank, size, weights_backend, mesh)


def _use_gpu(local_rank: int) -> None:
    """Make `cuda:local_rank` this process's current device (NCCL and the checkpoint's object collectives use it)."""
    count = torch.cuda.device_count()
    if local_rank >= count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        raise WorldError(
            f"LOCAL_RANK is {local_rank}, but only {count} CUDA device(s) are visible "
            f"(CUDA_VISIBLE_DEVICES={visible}): start at most {count} ranks per node "
            "(torchrun --nproc-per-node), one per GPU"
        )
    torch.cuda.set_device(local_rank)
