"""`inflight.learn --lora-rank R` as a process (inflight/learn/adapter.py, learner/lora.py): a learner replaying a
journal trains only adapters, checkpoints the adapter alone, resumes from it, and
exports `hf-final` as a PEFT adapter (and `hf-final-merged` with `--lora-merge-final`)."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed.checkpoint as dcp
from peft import PeftModel
from safetensors import safe_open
from safetensors.torch import load_file
from test_learn import wait_exit
from test_learn_torchrun import LR, run_learner
from test_replay import TRAINING, interleaved_records, learner
from test_serve import free_port
from transformers import AutoModelForCausalLM

from inflight.learn.store import RolloutJournal
from learner.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoraSpec, parameter_counts
from learner.model import load_policy

LORA = ["--lora-rank", "4", "--lora-targets", "q_proj,v_proj", "--lora-merge-final"]


def run(model, run_dir, recording, *extra: str) -> str:
    """One learner process replaying `recording` to its end (or --steps); its output."""
    process, _ = learner(model, run_dir, "--replay", str(recording), *TRAINING, *LORA, *extra)
    try:
        assert wait_exit(process, 300) == 0, process.tail()
        return "\n".join(process.lines)
    finally:
        process.stop()


def test_a_lora_learner_checkpoints_resumes_and_exports_a_peft_adapter_and_the_merged_model(model_dirs, tmp_path):
    model, run_dir = model_dirs["tiny-llama"], tmp_path / "run"
    RolloutJournal(tmp_path / "rec" / "journal").append(interleaved_records(groups=5))  # 2 steps of 2 groups
    first = run(model, run_dir, tmp_path / "rec", "--steps", "1")
    counts = parameter_counts(load_policy(model, lora=LoraSpec(4, 4.0, ("q_proj", "v_proj"))))
    assert f"trainable parameters {counts['trainable_params']} of {counts['total_params']}" in first
    checkpoint = run_dir / "checkpoints" / "step-00000001"
    saved = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    assert {k for k in saved if k.startswith("model.")} and all(".lora_" in k for k in saved if k.startswith("model."))

    second = run(model, run_dir, tmp_path / "rec", "--resume")
    assert "resumed from" in second and "step 1, version 1" in second
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]  # the resumed run trained the second step only

    final = run_dir / "hf-final"
    config = json.loads((final / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 4.0, ["q_proj", "v_proj"])
    with safe_open(str(final / ADAPTER_WEIGHTS), "pt") as f:
        assert f.metadata()["inflight_version"] == "2"
    adapter = load_file(str(final / ADAPTER_WEIGHTS))
    assert any(k.endswith("lora_B.weight") and t.abs().max() > 0 for k, t in adapter.items())  # B left zero: trained
    fp32 = {"dtype": torch.float32}  # the checkpoint is bf16: loaded as is, bf16 rounding would hide the adapter
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model, **fp32), final)
    merged = AutoModelForCausalLM.from_pretrained(run_dir / "hf-final-merged", **fp32)
    ids = torch.tensor([[11, 57, 300, 12, 9, 4]])
    with torch.no_grad():
        want, got = loaded(input_ids=ids).logits, merged(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(model, **fp32)(input_ids=ids).logits
    assert (want - got).abs().max() < 1e-4 < (want - base).abs().max()  # fp32 noise vs a trained adapter


def test_a_two_rank_torchrun_lora_learner_trains_and_exports_the_adapter_like_one_process(model_dirs, tmp_path):
    """The whole learner under torchrun (FSDP2 over gloo): the adapter gathered to rank 0 at every publish and at the
    export, its sharded checkpoint; the exported adapter agrees with a 1-process run's within a fraction of lr."""
    torchrun = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc-per-node", "2", "--master-port",
                str(free_port())]  # fmt: skip
    lora = ("--lora-rank", "4")
    run_learner([sys.executable], model_dirs["tiny-llama"], tmp_path / "one", *lora)
    run_learner(torchrun, model_dirs["tiny-llama"], tmp_path / "two", *lora)
    one, two = (load_file(str(tmp_path / run / "hf-final" / ADAPTER_WEIGHTS)) for run in ("one", "two"))
    assert one.keys() == two.keys() and len(one) == 2 * 7 * 2  # 2 layers x 7 projections x (A, B)
    moved = max(t.abs().max().item() for k, t in one.items() if k.endswith("lora_B.weight"))  # B starts at zero
    assert moved > 0.5 * LR  # the step really trained
    assert max((one[k] - two[k]).abs().max().item() for k in one) <= 0.1 * LR
    saved = dcp.FileSystemReader(str(tmp_path / "two" / "checkpoints" / "step-00000001")).read_metadata()
    assert all(".lora_" in k for k in saved.state_dict_metadata if k.startswith("model."))
