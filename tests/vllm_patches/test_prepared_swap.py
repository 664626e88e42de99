"""Narrow unit tests of the prepared swap's bookkeeping on plain torch modules (the real-engine proofs are in
test_swap_exact.py and test_update_faults.py): what a swap installs, removes and puts back."""

from __future__ import annotations

import pytest
import torch

from vllm_patches import faults
from vllm_patches.prepared import _MISSING, PreparedWeights, _changed, shadow_tree


def two_layers() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))


def test_a_shadow_tree_shares_tensors_but_owns_its_dicts_and_keeps_a_module_used_twice_as_one():
    model = two_layers()
    model.add_module("again", model[0])  # a tied layer: the same module object twice in the tree
    root, pairs = shadow_tree(model)
    assert root[0] is not model[0] and root.again is root[0], "aliasing must survive the copy"
    assert root[0].weight is model[0].weight, "tensors are shared until the shadow loads new ones"
    root[0]._parameters["weight"] = torch.nn.Parameter(torch.zeros(3, 3))
    assert model[0].weight.abs().sum() > 0, "the live module's parameter dict must not change with the shadow's"
    assert set(pairs) == {model, model[0], model[1]}


def test_a_swap_installs_new_attributes_removes_dropped_ones_and_leaves_children_live():
    model = two_layers()
    live = model[0]
    live.kernel = "old packed handle"
    live.stale = 1
    shadow = shadow_tree(live)[0]
    shadow._parameters["weight"] = torch.nn.Parameter(torch.ones(3, 3))
    shadow.kernel = "new packed handle"
    del shadow.stale
    prepared = PreparedWeights(1, [(live, _changed(live, shadow))])
    assert prepared.swap_in() == 1
    assert torch.equal(live.weight, torch.ones(3, 3)) and live.kernel == "new packed handle"
    assert not hasattr(live, "stale")
    assert model(torch.ones(1, 3)).shape == (1, 2), "the swapped module still runs in its parent"


def test_a_failure_part_way_through_a_swap_puts_back_every_layer_already_swapped():
    model = two_layers()
    before = {n: p.clone() for n, p in model.named_parameters()}
    layers = []
    for live in model:
        shadow = shadow_tree(live)[0]
        shadow._parameters["weight"] = torch.nn.Parameter(torch.full_like(live.weight, 7.0))
        layers.append((live, _changed(live, shadow)))
    with pytest.raises(faults.InjectedFault):
        PreparedWeights(1, layers).swap_in(_fail_after_first(layers))
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), f"{name} was left swapped after the failure"


def _fail_after_first(layers):
    yield layers[0]
    raise faults.InjectedFault("injected fault: after the first layer")


def test_a_changed_attribute_set_marks_what_the_live_module_had_and_the_shadow_dropped():
    live = torch.nn.Linear(2, 2)
    live.extra = object()
    shadow = shadow_tree(live)[0]
    del shadow.extra
    changed = _changed(live, shadow)
    assert changed["extra"] is _MISSING and "_modules" not in changed


@pytest.mark.parametrize("spec", ["prepare", "swap@0", "load@1", "prepare@x", "swap@1:x"])
def test_a_malformed_fault_plan_is_refused_naming_the_item_and_the_form(spec):
    with pytest.raises(ValueError, match=r"INFLIGHT_FAULT_UPDATE has .*expected <phase>@<n>\[:<rank>\]"):
        faults._parse(spec)


def test_a_fault_plan_fails_exactly_the_planned_updates_half_way():
    plan = faults._parse("prepare@1,swap@2, swap@3:1")
    assert plan == {"prepare": frozenset({(1, None)}), "swap": frozenset({(2, None), (3, 1)})}
    items = list(range(10))
    assert list(faults.half_way(items, "prepare", 2)) == items  # not planned (PLANNED is empty here): all of them


def test_a_shadow_tree_is_freed_by_reference_counting_alone_once_dropped():
    """No reference cycle: a big engine process defers Python's full collection for dozens of updates, and a shadow
    tree waiting for it holds a processed copy of the weights (a recursive closure in shadow_tree kept every one:
    SmolLM2's worker grew by GBs)."""
    import gc
    import weakref

    model = two_layers()
    gc.disable()
    try:
        root, pairs = shadow_tree(model)
        refs = [weakref.ref(shadow) for shadow in pairs.values()]
        del root, pairs
        assert all(ref() is None for ref in refs), "a shadow module outlived its last reference"
    finally:
        gc.enable()


class _ReadsTheConfig(torch.nn.Module):
    """A model whose loader reads vLLM's current config, as expert-parallel MoE and mxfp4 layers' loaders do."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def load_weights(self, weights):
        from vllm.config import get_current_vllm_config

        list(weights)
        self.seen.append(get_current_vllm_config())


def test_the_staging_thread_prepares_under_the_workers_vllm_config_which_loaders_read_and_raise_without():
    import threading

    from vllm.config import VllmConfig

    from vllm_patches.prepared import ShadowPreparer

    model, config, errors = _ReadsTheConfig(), VllmConfig(), []

    def stage():  # a thread of its own, as the staging thread: vLLM's current config is process-global, unset here
        try:
            ShadowPreparer(model, 1, 1, config)({"w": torch.zeros(2)})
        except Exception as exc:
            errors.append(exc)

    thread = threading.Thread(target=stage)
    thread.start()
    thread.join()
    assert not errors and model.seen == [config]
    with pytest.raises(AssertionError, match="Current vLLM config is not set"):
        ShadowPreparer(model, 1, 1)({"w": torch.zeros(2)})


def test_a_swap_settled_as_not_kept_puts_every_old_attribute_back():
    """Tensor parallelism: this rank swapped, another failed, so this one is rolled back (the undo kept by swap_in)."""
    model = two_layers()
    live = model[0]
    old_weight, live.kernel = live.weight, "old packed handle"
    shadow = shadow_tree(live)[0]
    shadow._parameters["weight"] = torch.nn.Parameter(torch.ones(3, 3))
    shadow.kernel = "new packed handle"
    shadow.added = 1
    prepared = PreparedWeights(1, [(live, _changed(live, shadow))])
    prepared.swap_in()
    assert live.kernel == "new packed handle" and live.added == 1
    prepared.settle(keep=False)
    assert live.weight is old_weight and live.kernel == "old packed handle" and not hasattr(live, "added")
    assert prepared.replaced == []
