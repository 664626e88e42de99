"""The learner hands a serve an MoE model's weights under the checkpoint's names (learner/export.py:checkpoint_named):
transformers 5 fuses the per-expert matrices into one 3D tensor when it loads them, the serve loads the checkpoint.
`hf_layout`, what a streaming learner checks serves against, names the same tensors from the shards alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from moe_models import FAMILIES, save_tiny_moe
from safetensors.torch import load_file

from learner.export import checkpoint_tensor_names, full_hf_state, hf_layout, iter_full_pieces
from learner.model import load_policy


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
    # what a streaming learner checks serves against, gathering nothing: the same names, order, dtypes and shapes
    assert layout_of(hf_layout(model)) == layout_of(state) and all(t.is_meta for t in hf_layout(model).values())


def layout_of(state: dict[str, torch.Tensor]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    return [(name, t.dtype, tuple(t.shape)) for name, t in state.items()]


def two_rank_pieces(rank: int, tmp: str, model_dir: str) -> None:
    """One spawned rank of a 2-rank gloo FSDP2 learner on `model_dir`: rank 0 saves what it gets of iter_full_pieces
    and full_hf_state."""
    from spawn_support import process_group

    torch.set_num_threads(1)
    with process_group(f"{tmp}/store", rank, 2, timeout_s=180):
        save_rank0_pieces(rank, tmp, model_dir)


def save_rank0_pieces(rank: int, tmp: str, model_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from learner.model import shard_policy

    mesh = dist.device_mesh.init_device_mesh("cpu", (2,))
    model = shard_policy(load_policy(model_dir), mesh)
    gathers = []  # every tensor gathered whole while streaming: none, the fused experts included
    whole = DTensor.full_tensor
    DTensor.full_tensor = lambda self, *a, **k: gathers.append(tuple(self.shape)) or whole(self, *a, **k)
    try:
        pieces = [(p.name, p.shape, p.start, p.tensor.clone()) for p in iter_full_pieces(model, 1 << 12)]
    finally:
        DTensor.full_tensor = whole
    full = full_hf_state(model)
    if rank == 0:  # the layout of the full state, from this rank's shards alone
        layout = layout_of(hf_layout(model))
        torch.save({"pieces": pieces, "full": full, "layout": layout, "gathers": gathers}, f"{tmp}/rank0.pt")


def test_a_sharded_learner_streams_the_experts_an_expert_at_a_time_under_the_checkpoints_names_bitwise(
    model_dirs, tmp_path
):
    import torch.multiprocessing as mp

    model_dir = model_dirs["tiny-moe"]
    mp.spawn(two_rank_pieces, args=(str(tmp_path), str(model_dir)), nprocs=2, join=True)
    got = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assembled: dict[str, torch.Tensor] = {}
    for name, shape, start, block in got["pieces"]:
        whole = assembled.setdefault(name, torch.empty(shape, dtype=block.dtype))
        whole[start : start + len(block)] = block
    stored = {name: t.float() for name, t in load_file(model_dir / "model.safetensors").items()}
    assert set(assembled) == set(got["full"]) == set(stored)
    assert got["layout"] == layout_of(got["full"])
    # an MoE layer's experts came an expert at a time (4 KiB blocks < one 64-KiB expert), none gathered whole
    assert got["gathers"] == []
    expert_pieces = [block for name, _, _, block in got["pieces"] if ".experts." in name]
    assert expert_pieces and max(b.numel() * b.element_size() for b in expert_pieces) <= 128 * 64 * 4
    for name, want in stored.items():
        assert torch.equal(assembled[name], want) and torch.equal(got["full"][name], want), name
