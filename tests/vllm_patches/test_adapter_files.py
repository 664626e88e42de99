"""The serve's adapter files (vllm_patches/adapter.py), without an engine: the zero adapter a serve starts from has
exactly the tensors PEFT itself makes for the same LoRA config (names, shapes), its config reads back as the same
AdapterSpec, and the checks that refuse an update of another kind or shape name what differs and the flag to fix."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from transformers import AutoModelForCausalLM

from inflight.models import model_dir
from inflight.wire.weights import AdapterSpec, ManifestError
from vllm_patches.adapter import ServedAdapter, check_adapter_update, engine_lora_rank, write_zero_adapter

TARGETS = sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


@pytest.mark.parametrize("name", ["tiny-qwen2", "smollm2"])
def test_the_zero_adapter_has_the_tensors_peft_makes_for_the_same_config_and_reads_back_as_its_spec(name, tmp_path):
    spec = AdapterSpec(8, 16.0, TARGETS)
    served = ServedAdapter.read(write_zero_adapter(model_dir(name), tmp_path / "zero", spec))
    hf = AutoModelForCausalLM.from_pretrained(model_dir(name), torch_dtype=torch.float32)
    peft_model = get_peft_model(hf, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0))
    peft_state = get_peft_model_state_dict(peft_model)
    assert served.expected == {n: ("float32", list(t.shape)) for n, t in peft_state.items()}
    assert served.spec == spec


def test_targets_that_name_no_module_of_the_model_are_refused_naming_them(tmp_path):
    with pytest.raises(ValueError, match=r"--lora-targets qkv: no 2-D weight of .* is in such a module"):
        write_zero_adapter(model_dir("tiny-qwen2"), tmp_path / "none", AdapterSpec(8, 16.0, ["qkv"]))


def test_an_update_of_another_kind_or_shape_is_refused_naming_what_differs_and_the_flag():
    served = ServedAdapter("/a", AdapterSpec(8, 16.0, TARGETS), {}, {})
    with pytest.raises(ManifestError, match=r"rank: 16 vs 8; targets: .* same --lora-rank, --lora-alpha"):
        check_adapter_update(AdapterSpec(16, 16.0, ["q_proj"]), served)
    with pytest.raises(ManifestError, match=r"reached a serve without an adapter: start the serve with --lora-rank 8"):
        check_adapter_update(AdapterSpec(8, 16.0, TARGETS), None)
    with pytest.raises(ManifestError, match=r"full-weights update reached a serve of a rank-8 adapter"):
        check_adapter_update(None, served)
    check_adapter_update(None, None)
    check_adapter_update(AdapterSpec(8, 16.0, TARGETS), served)


def test_vllm_gets_the_smallest_max_lora_rank_that_holds_the_adapter():
    assert [engine_lora_rank(r) for r in (1, 4, 8, 9, 64, 100)] == [1, 8, 8, 16, 64, 128]
    with pytest.raises(ValueError, match="--lora-rank is 600"):
        engine_lora_rank(600)


@pytest.mark.parametrize("name", ["tiny-qwen2", "smollm2", "tiny-moe"])
def test_the_serves_default_targets_are_the_learners_for_the_same_model(name):
    from learner.lora import decoder_linear_names
    from vllm_patches.adapter import decoder_linear_targets

    hf = AutoModelForCausalLM.from_pretrained(model_dir(name), torch_dtype=torch.float32)
    assert decoder_linear_targets(model_dir(name)) == decoder_linear_names(hf)


def test_vllm_is_told_the_served_adapters_modules_so_the_experts_and_the_router_get_no_lora(tmp_path):
    """vLLM's deployment-time target filter, asked through its own function with Qwen3-MoE's packed modules: the fused
    experts stay unwrapped (the adapter never touches them) and no module outside the adapter gets LoRA buffers."""
    from vllm.lora.utils import is_in_target_modules
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

    from vllm_patches.engine import EngineConfig, lora_kwargs

    attention = ["k_proj", "o_proj", "q_proj", "v_proj"]
    adapter = write_zero_adapter(model_dir("tiny-moe"), tmp_path / "a", AdapterSpec(8, 16.0, attention))
    knobs = {"enforce_eager": True, "dtype": "bfloat16", "head_dtype": "model", "update_memory": "double"}
    cfg = EngineConfig(model=str(model_dir("tiny-moe")), lora_dir=str(adapter), lora_rank=8, routing_replay=False,
                       **knobs)  # fmt: skip
    kwargs = lora_kwargs(cfg)
    assert kwargs["lora_target_modules"] == attention and kwargs["max_lora_rank"] == 8
    packed = dict(Qwen3MoeForCausalLM.packed_modules_mapping)
    wrapped = {m: is_in_target_modules(f"model.layers.0.{m}", kwargs["lora_target_modules"], packed)
               for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.experts", "mlp.gate")}  # fmt: skip
    assert wrapped == {"self_attn.qkv_proj": True, "self_attn.o_proj": True, "mlp.experts": False, "mlp.gate": False}


@pytest.mark.parametrize(("name", "device", "refused"), [
    ("tiny-moe", "cpu", True), ("tiny-moe", "cuda", False), ("tiny-moe", "cuda:1", False), ("tiny-qwen2", "cpu", False),
])  # fmt: skip
def test_an_adapter_on_a_moe_model_is_refused_off_cuda_before_the_engine_starts_naming_the_fix(name, device, refused):
    """With LoRA on, vLLM 0.32 runs MoE layers only through its Triton LoRA kernel: a CPU worker died at its first
    forward pass (AttributeError in triton_moe.py) before this refusal."""
    from vllm_patches.adapter import check_lora_kernels

    if not refused:
        check_lora_kernels(str(model_dir(name)), device)
        return
    with pytest.raises(ValueError, match=r"--lora-rank on .*tiny-moe \(qwen3_moe\) needs a CUDA serve.*--serve-gpus"):
        check_lora_kernels(str(model_dir(name)), device)
