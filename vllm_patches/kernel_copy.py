"""The copy commit's tensors: prepared layers named as vLLM's kernel-format weights and checked against the live model.

Runs in the worker, on the engine thread, at the commit of `--update-memory double` under CUDA graphs
(vllm_patches/commit.py:copy_in hands the list to vLLM's kernel-format reload). Torch alone, no vLLM: the GPU checks
(tests/wire/test_cuda_serve_checks.py) run it on a machine without vLLM.
"""

from __future__ import annotations

import torch

from inflight.wire.weights import ManifestError


def kernel_weights(layers: list[tuple[torch.nn.Module, dict[str, object]]], model: torch.nn.Module):
    """(the live parameter's name in `model`, its new tensor) for every tensor the prepared `layers` (pairs of a live
    module and the attributes it takes from its processed shadow: vllm_patches/prepared.py) replace, each live parameter
    once (a tied head is the embedding). Checked whole before anything is written, because `copy_` broadcasts and casts
    in silence: every new tensor must have a live parameter of its shape, dtype and device, and processing must have
    replaced no buffer (vLLM's kernel-format reload copies parameters only). Raises ManifestError naming the first
    that does not fit."""
    names = {module: name for name, module in model.named_modules(remove_duplicate=False)}
    weights, seen = [], set()
    for live, new in layers:
        prefix = names[live] + "." if names[live] else ""
        for name, _ in _replaced(live._buffers, new.get("_buffers")):
            raise ManifestError(
                f"{prefix}{name}: processing replaced this buffer, which the copy commit (vLLM's kernel-format "
                "reload) does not copy: serve with --update-memory low"
            )
        for name, tensor in _replaced(live._parameters, new.get("_parameters")):
            old = live._parameters.get(name)
            _check_fits(prefix + name, tensor, old)
            if id(old) not in seen:
                seen.add(id(old))
                weights.append((prefix + name, tensor))
    return weights


def _replaced(live: dict, new: dict | object) -> list[tuple[str, torch.Tensor]]:
    """The tensors of `new` (a shadow's parameter or buffer dict, if processing replaced it) that are not `live`'s."""
    if not isinstance(new, dict):
        return []
    return [(n, t) for n, t in new.items() if t is not None and t is not live.get(n)]


def _check_fits(name: str, new: torch.Tensor, old: torch.Tensor | None) -> None:
    if old is None:
        raise ManifestError(
            f"{name}: processing added this parameter, which the live model does not have, so the copy commit cannot "
            "write it: serve with --update-memory low"
        )
    if (new.shape, new.dtype, new.device) != (old.shape, old.dtype, old.device):
        raise ManifestError(
            f"{name}: the prepared tensor is {tuple(new.shape)} {new.dtype} on {new.device}, the live parameter "
            f"{tuple(old.shape)} {old.dtype} on {old.device}: the copy commit writes into the live storage and needs "
            "both alike; serve with --update-memory low"
        )
