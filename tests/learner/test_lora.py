"""LoRA training in one process (learner/lora.py, issue 31) with real PEFT: what trains, the logprobs against PEFT's
merged model, the adapter's names and files against PEFT's own, checkpoints, and a bad `--lora-targets`.

The 2-rank (FSDP2) runs are in test_lora_distributed.py.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lora_support import PAD, SPEC, lora_policy, rollouts
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from tolerances import (
    assert_within,
    check_within,
    float64_bound,
    lm_head_logprob_bound,
    logprob_gradient_bound,
    policy_loss_bound,
)
from transformers import AutoModelForCausalLM

from inflight.config import parse_dataclass
from inflight.learn.adapter import lora_spec
from inflight.learn.config import LearnConfig
from inflight.wire.contract import SamplingKnobs
from learner.checkpoint import checkpoint_dir, latest_checkpoint, load_checkpoint, save_checkpoint
from learner.export import full_hf_state
from learner.fused_loss import aggregation_weights
from learner.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    LoraSpec,
    adapter_state,
    is_lora_name,
    parameter_counts,
    save_adapter,
    save_merged,
)
from learner.model import PolicyModel, load_policy
from learner.step import TrainConfig, make_batch, make_optimizer, train_step

MODELS = ("tiny-llama", "tiny-qwen2")  # a tied and an untied LM head
LENGTHS = ((4, 6), (2, 3), (5, 2))
CFG = TrainConfig(lr=1e-3, sampling=SamplingKnobs(temperature=0.8))


def batch_for(model: PolicyModel, seed: int = 0):
    return make_batch(rollouts(model.hf.config.vocab_size, seed, LENGTHS), PAD)


def logprobs(model: PolicyModel, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(batch.input_ids, batch.targets, CFG.sampling.temperature).logp


def head_bound(model: PolicyModel, batch, dtype: torch.dtype) -> float:
    """`lm_head_logprob_bound` for `model`'s head on this batch's real positions (see test_model.py for why it
    covers a 2-layer decoder's own rounding too)."""
    with torch.no_grad():
        hidden = model.hf.model(input_ids=batch.input_ids).last_hidden_state[batch.mask]
    return lm_head_logprob_bound(dtype, hidden, model.hf.lm_head.weight, CFG.sampling.temperature)


@pytest.mark.parametrize("name", MODELS)
def test_base_weights_are_frozen_and_only_the_adapters_reach_the_optimizer(name: str, model_dirs) -> None:
    model = lora_policy(model_dirs[name], torch.float32)
    optimizer = make_optimizer(model, CFG)

    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert trainable == {n for n, _ in model.named_parameters() if is_lora_name(n)}
    assert {n.split(".lora_")[1][0] for n in trainable} == {"A", "B"}  # lora_A and lora_B, nothing else
    assert optimized == {id(p) for n, p in model.named_parameters() if n in trainable}
    counts = parameter_counts(model)
    layers = model.hf.config.num_hidden_layers
    assert counts["trainable_params"] == sum(p.numel() for n, p in model.named_parameters() if n in trainable) > 0
    assert len(trainable) == layers * 7 * 2  # q,k,v,o,gate,up,down: an A and a B each
    assert counts["total_params"] == sum(p.numel() for p in model.parameters())


def test_a_train_step_changes_only_the_adapter_tensors(model_dirs) -> None:
    model = lora_policy(model_dirs["tiny-llama"], torch.float32)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    metrics = train_step(model, make_optimizer(model, CFG), batch_for(model), CFG)

    after = model.state_dict()
    assert metrics["grad_norm"] > 0
    for name, tensor in after.items():
        if is_lora_name(name):
            assert not torch.equal(tensor, before[name]), f"{name} did not train"
        else:
            assert torch.equal(tensor, before[name]), f"{name} is a base weight and changed"


@pytest.mark.parametrize("name", MODELS)
def test_lora_logprobs_equal_those_of_the_peft_merged_model(name: str, model_dirs, tmp_path: Path) -> None:
    model = lora_policy(model_dirs[name], torch.float32)
    batch = batch_for(model)
    save_adapter(model, model_dirs[name], tmp_path / "adapter", version=0)
    # save_merged is PeftModel.from_pretrained(base, adapter).merge_and_unload(): what --lora-merge-final writes
    merged = load_policy(save_merged(tmp_path / "adapter", model_dirs[name], tmp_path / "merged", torch.float32))
    base = load_policy(model_dirs[name])

    got, want, plain = logprobs(model, batch), logprobs(merged, batch), logprobs(base, batch)
    # fp32, both sides: x·(W + s·B·A) against x·W + s·(x·A)·B; both err by the bound test_model.py uses
    bound = 2 * head_bound(merged, batch, torch.float32)
    assert_within(got[batch.mask], want[batch.mask], bound, "LoRA against merged logprobs")
    assert (plain - want)[batch.mask].abs().max() > 100 * bound  # the adapter moves logprobs: the test can fail


@pytest.mark.parametrize("name", MODELS)
def test_adapter_state_has_the_names_and_shapes_peft_saves(name: str, model_dirs, tmp_path: Path) -> None:
    model = lora_policy(model_dirs[name], torch.float32)
    reference = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dirs[name]),
        LoraConfig(r=SPEC.rank, lora_alpha=SPEC.alpha, target_modules="all-linear", bias="none"),
    )
    reference.save_pretrained(tmp_path / "peft")
    saved = load_file(str(tmp_path / "peft" / ADAPTER_WEIGHTS))

    state = adapter_state(model)
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in state
    assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in saved.items()}
    live = dict(model.named_parameters())["hf.model.layers.0.self_attn.q_proj.lora_B.default.weight"]
    assert torch.equal(state["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"], live)


@pytest.mark.parametrize("name", MODELS)
def test_a_saved_hf_final_adapter_loads_with_peft_and_gives_the_same_logprobs(name, model_dirs, tmp_path) -> None:
    model = lora_policy(model_dirs[name], torch.float32)
    train_step(model, make_optimizer(model, CFG), batch_for(model, seed=3), CFG)  # trained A and B, not the init
    batch = batch_for(model)
    save_adapter(model, model_dirs[name], tmp_path, version=7)

    config = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 8.0, str(model_dirs[name]))
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert config["task_type"] == "CAUSAL_LM"
    base = AutoModelForCausalLM.from_pretrained(model_dirs[name], dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, tmp_path)
    assert set(load_file(str(tmp_path / ADAPTER_WEIGHTS))) == set(adapter_state(model))
    # the same modules and the same weights compute the same thing: equal, not merely close
    assert torch.equal(logprobs(PolicyModel(loaded.base_model.model), batch), logprobs(model, batch))


@pytest.mark.parametrize("name", MODELS)  # tiny-llama: a tied head, the embedding under a second name
def test_checkpoint_resume_restores_adapter_and_optimizer_state_without_base_weights(name, model_dirs, tmp_path):
    model = lora_policy(model_dirs[name], torch.float32)
    optimizer = make_optimizer(model, CFG)
    train_step(model, optimizer, batch_for(model, seed=1), CFG)
    save_checkpoint(checkpoint_dir(tmp_path, 1), model, optimizer, {"version": 1})
    restored = lora_policy(model_dirs[name], torch.float32, seed=5)  # other A and B, no Adam state
    restored_optimizer = make_optimizer(restored, CFG)

    assert load_checkpoint(latest_checkpoint(tmp_path), restored, restored_optimizer) == {"version": 1}

    assert_adapters_equal(restored, model)
    saved = dcp.FileSystemReader(str(checkpoint_dir(tmp_path, 1))).read_metadata().state_dict_metadata
    weights = {k.removeprefix("model.") for k in saved if k.startswith("model.")}
    assert weights == {n for n, _ in model.named_parameters() if is_lora_name(n)}  # the adapter, no base weight
    train_step(model, optimizer, batch_for(model, seed=2), CFG)
    train_step(restored, restored_optimizer, batch_for(model, seed=2), CFG)
    assert_adapters_equal(restored, model)  # identical Adam moments and step count: an identical next step


def assert_adapters_equal(a: PolicyModel, b: PolicyModel) -> None:
    state_a, state_b = adapter_state(a), adapter_state(b)
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        assert torch.equal(state_a[key], state_b[key]), key


def test_full_hf_state_of_a_lora_policy_is_the_base_checkpoint(model_dirs) -> None:
    model = lora_policy(model_dirs["tiny-qwen2"], torch.float32)
    plain = full_hf_state(load_policy(model_dirs["tiny-qwen2"]))
    state = full_hf_state(model)  # what the serves are checked against at Hello: the base they load
    assert state.keys() == plain.keys()
    assert all(torch.equal(state[k], plain[k]) for k in plain)


def test_lora_targets_naming_a_module_the_model_lacks_are_refused_naming_those_it_has(model_dirs) -> None:
    expected = "q_proj_x.*down_proj,gate_proj,k_proj,o_proj,q_proj,up_proj,v_proj"
    with pytest.raises(ValueError, match=expected):
        load_policy(model_dirs["tiny-llama"], lora=LoraSpec(rank=2, alpha=2.0, targets=("q_proj", "q_proj_x")))
    with pytest.raises(ValueError, match="lm_head .*--lora-targets"):  # the head's weight is read directly
        load_policy(model_dirs["tiny-llama"], lora=LoraSpec(rank=2, alpha=2.0, targets=("lm_head",)))


def test_lora_flags_give_the_spec_and_bad_ones_are_refused_at_start(capsys: pytest.CaptureFixture) -> None:
    argv = ["--lora-rank", "16", "--lora-targets", "q_proj, v_proj"]
    assert lora_spec(parse_dataclass(LearnConfig, argv, "learn", "")) == LoraSpec(16, 16.0, ("q_proj", "v_proj"))
    assert lora_spec(parse_dataclass(LearnConfig, [], "learn", "")) is None  # full fine-tuning by default
    for bad, message in (
        (["--lora-dropout", "0.1"], "--lora-dropout is 0.1, expected 0"),
        (["--lora-rank", "0", "--lora-merge-final"], "--lora-merge-final is True, expected false without"),
        (["--lora-rank", "-1"], "--lora-rank is -1, expected >= 1, or 0"),
    ):
        with pytest.raises(SystemExit):
            parse_dataclass(LearnConfig, [*argv, *bad], "learn", "")
        assert message in capsys.readouterr().err


def test_a_merged_final_export_is_a_plain_hf_model_with_the_adapter_in_its_weights(model_dirs, tmp_path) -> None:
    model = lora_policy(model_dirs["tiny-llama"], torch.float32)
    save_adapter(model, model_dirs["tiny-llama"], tmp_path / "hf-final", version=1)
    out = save_merged(tmp_path / "hf-final", model_dirs["tiny-llama"], tmp_path / "merged", torch.float32)
    merged = load_file(str(out / "model.safetensors"))
    base = full_hf_state(load_policy(model_dirs["tiny-llama"]))
    assert not (out / ADAPTER_CONFIG).exists()  # transformers would otherwise load it as an adapter on a base
    assert merged.keys() == base.keys()
    name = "model.layers.0.self_attn.q_proj.weight"
    hf = model.hf.model.layers[0].self_attn.q_proj
    delta = SPEC.alpha / SPEC.rank * hf.lora_B["default"].weight @ hf.lora_A["default"].weight
    assert_within(merged[name], base[name] + delta.detach(), 1e-6, name)  # fp32 sums of 4 terms of ~1e-2


def test_the_fused_loss_step_of_a_lora_policy_equals_the_unfused_step(model_dirs) -> None:
    """fused_loss='on' (the LM head and the loss in one pass: the torch row pass here, Triton on CUDA) with a frozen
    LM head: the same loss and the same adapter after AdamW as logprobs then `policy_loss` (float64: logic)."""
    cfg = TrainConfig(lr=1e-3, sampling=SamplingKnobs(temperature=0.8), chunk_tokens=3)
    results = []
    for fused in ("off", "on"):
        model = lora_policy(model_dirs["tiny-llama"], torch.float64)
        batch = batch_for(model)
        optimizer = make_optimizer(model, cfg)
        metrics = train_step(model, optimizer, batch, replace(cfg, fused_loss=fused))
        max_grad = max(float(s["exp_avg"].abs().max()) for s in optimizer.state.values()) / (1 - cfg.betas[0])
        results.append((metrics, adapter_state(model), max_grad))
    (off, off_adapter, max_grad), (on, on_adapter, _) = results
    with torch.no_grad():
        hidden = model.hf.model(input_ids=batch.input_ids).last_hidden_state[batch.mask]
        logp = model(batch.input_ids, batch.targets, cfg.sampling.temperature).logp.flatten()
    relative = logprob_gradient_bound(torch.float64, hidden, model.hf.lm_head.weight, cfg.sampling.temperature, 1.0)
    weights = aggregation_weights(batch.mask.flatten(), batch.seq_ids.flatten(), cfg.loss.aggregation)
    loss_bound = policy_loss_bound(logp, batch.behaviour_logp.flatten(), batch.advantages.flatten(), weights,
                                   2 * relative, torch.float64)  # fmt: skip
    check_within(abs(on["loss"] - off["loss"]), loss_bound, "fused loss")
    # AdamW's first step moves a weight by lr·g/(|g| + eps): a gradient error ε = 4·δ·max|g| moves it by <= lr·ε/eps
    epsilon = 4 * relative * max_grad
    for key, tensor in off_adapter.items():
        bound = 3 * cfg.lr * epsilon / cfg.eps + float64_bound(3, float(tensor.abs().max()) + cfg.lr)
        assert_within(on_adapter[key], tensor, bound, key)
    assert on["grad_norm"] > 0 and off_adapter.keys() == on_adapter.keys()


def test_a_moe_policy_adapts_its_attention_and_leaves_router_and_fused_experts_alone(model_dirs) -> None:
    model = lora_policy(model_dirs["tiny-moe"], torch.float32)
    adapted = {name.split(".")[-4] for name, _ in model.named_parameters() if is_lora_name(name)}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj"}
    metrics = train_step(model, make_optimizer(model, CFG), batch_for(model), CFG)
    assert metrics["grad_norm"] > 0 and all(not p.requires_grad for n, p in model.named_parameters() if ".mlp." in n)


def test_a_moe_policy_saves_an_adapter_that_peft_loads_and_that_gives_the_same_logprobs(model_dirs, tmp_path) -> None:
    # PEFT keeps `target_parameters` as a set on a MoE model: the export once died writing it as JSON
    model = lora_policy(model_dirs["tiny-moe"], torch.float32)
    batch = batch_for(model)
    save_adapter(model, model_dirs["tiny-moe"], tmp_path, version=3)

    config = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    assert config["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    base = AutoModelForCausalLM.from_pretrained(model_dirs["tiny-moe"], dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, tmp_path)
    assert torch.equal(logprobs(PolicyModel(loaded.base_model.model), batch), logprobs(model, batch))
