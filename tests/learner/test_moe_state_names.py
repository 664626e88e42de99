"""The learner hands a serve an MoE model's weights under the checkpoint's names (learner/model.py:checkpoint_named):
transformers 5 fuses the per-expert matrices into one 3D tensor when it loads them, the serve loads the checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from moe_models import FAMILIES, save_tiny_moe
from safetensors.torch import load_file

from learner.model import checkpoint_tensor_names, full_hf_state, iter_full_pieces, load_policy


@pytest.fixture(scope="module", params=FAMILIES)
def moe_dir(request, model_dirs: dict[str, Path], tmp_path_factory) -> Path:
    if request.param == "qwen3_moe":
        return model_dirs["tiny-moe"]
    return save_tiny_moe(request.param, tmp_path_factory.mktemp(request.param), model_dirs["smollm2"])


def test_full_state_and_published_pieces_are_the_checkpoints_tensors_under_its_names(moe_dir):
    model = load_policy(moe_dir)
    stored = {name: t.float() for name, t in load_file(moe_dir / "model.safetensors").items()}
    state = full_hf_state(model)
    pieces = {p.name: p.tensor for p in iter_full_pieces(model)}
    assert set(state) == set(pieces) == checkpoint_tensor_names(moe_dir)
    for name, want in stored.items():
        assert torch.equal(state[name], want) and torch.equal(pieces[name], want), name
