"""What the commit paths hand vLLM's loaders on a tensor-parallel rank (issue 41, vllm_patches/placement.py:
SliceCarrier): a checkpoint-shaped tensor that allocates nothing beyond the rank's kept slice and yields exactly that
slice to the loader's own narrow, and refuses — naming the tensor — any other narrow or any read of data it does not
hold. No engine: the swap-exactness proof on the real loaders is tests/vllm_patches/test_sliced_staging.py."""

from __future__ import annotations

import pytest
import torch

from inflight.wire.weights import ManifestError
from vllm_patches.placement import Placement, SliceLayout

ROWS = Placement(
    "model.layers.0.mlp.up_proj.weight", "slice", (8, 6), "model.layers.0.mlp.gate_up_proj.weight", 0, 4, 4
)
COLUMNS = Placement(
    "model.layers.0.mlp.down_proj.weight", "slice", (6, 8), "model.layers.0.mlp.down_proj.weight", 1, 0, 4
)


def carrier(placement: Placement, kept: torch.Tensor) -> torch.Tensor:
    ((_, out),) = SliceLayout([placement]).carriers([(placement.name, kept)])
    return out


def test_a_carrier_has_the_checkpoint_shape_and_hands_the_loaders_narrow_the_kept_slice_itself():
    for placement in (ROWS, COLUMNS):
        kept = torch.randn(placement.kept_shape)
        whole = carrier(placement, kept)
        assert whole.shape == placement.shape and whole.dtype == kept.dtype and whole.device == kept.device
        assert whole.narrow(placement.dim, placement.start, placement.length) is kept
        assert whole.narrow(placement.dim - len(placement.shape), placement.start, placement.length) is kept
        assert whole.to("cpu") is whole and whole.contiguous() is whole  # what loaders do before narrowing


def test_a_carrier_allocates_nothing_of_the_whole_tensor():
    huge = Placement("lm_head.weight", "slice", (1 << 40, 1024), "lm_head.weight", 0, 0, 4)  # 4 PiB of float32
    whole = carrier(huge, torch.randn(4, 1024))
    assert whole.shape == (1 << 40, 1024) and whole.data_ptr() == 0


def test_a_carrier_survives_the_moe_layers_unsqueeze_and_unbind_of_one_expert():
    kept = torch.randn(ROWS.kept_shape)
    (expert,) = carrier(ROWS, kept).unsqueeze(0).unbind()
    assert expert.shape == ROWS.shape and expert.narrow(0, ROWS.start, ROWS.length) is kept


@pytest.mark.parametrize(
    "use",
    [
        lambda t: t.narrow(0, 0, 4),  # another rank's rows
        lambda t: t.narrow(1, 0, 3),  # another dim
        lambda t: t.t(),
        lambda t: t[0],
        lambda t: t.clone(),
        lambda t: torch.zeros(8, 6).copy_(t),
        lambda t: t.unsqueeze(1),
        lambda t: t.unbind(),
    ],
    ids=["other-rows", "other-dim", "transpose", "index", "clone", "copy", "unsqueeze-1", "unbind-no-lead"],
)
def test_a_loader_that_slices_otherwise_than_the_placement_fails_naming_the_tensor(use):
    with pytest.raises(ManifestError, match="up_proj.weight.*not the one resolved"):
        use(carrier(ROWS, torch.randn(ROWS.kept_shape)))


def test_a_kept_slice_of_the_wrong_shape_is_refused_before_any_loader_sees_it():
    with pytest.raises(ManifestError, match=r"kept \[3, 6\], the layout says \[4, 6\]"):
        carrier(ROWS, torch.randn(3, 6))
