"""Resumable learner checkpoints: sharded model + optimizer state (torch.distributed.checkpoint) and a JSON meta.

The learner loop calls `save_checkpoint` every k steps on every rank (collective) and, at start-up,
`latest_checkpoint(root)` then `load_checkpoint` to resume. Layout under a root directory:

    root/step-00000120/   DCP shard files + `.metadata`, then `meta.json` (version, rollout position, config, …)
    root/latest           the name of the newest complete checkpoint directory

Commit order makes an interrupted save harmless: every rank writes its shards (DCP), rank 0 writes `meta.json`
(tmp + rename) only after DCP returns, and only then repoints `latest` (tmp + rename). A crash at any point leaves
`latest` naming the previous complete checkpoint. One code path serves N ranks and a single process: DCP runs
without a process group when torch.distributed is not initialised (it then saves and loads this process's tensors).
The number of ranks may differ between save and load (DCP reshards on load).

Frozen parameters are not saved (LoRA training, learner/lora.py: the base weights never change and are loaded from
the base model), so a LoRA checkpoint holds the adapters and their optimizer state only; with full fine-tuning
nothing is frozen and every parameter is saved.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

META_FILE = "meta.json"
LATEST_FILE = "latest"
# Not strict: the frozen weights are absent on purpose. A trainable one missing from the checkpoint still fails, in
# dcp.load, which loads every key the model's (trainable) state asks for.
_LOADED = StateDictOptions(strict=False)


def save_checkpoint(
    path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, meta: dict[str, Any]
) -> Path:
    """Save model and optimizer state into the new directory `path` and make it `path.parent`'s latest.

    Collective: every rank calls it with the same `path` (on a filesystem all ranks share). `meta` must be
    JSON-serialisable; it is returned by `load_checkpoint`. Returns `path`.
    """
    path = Path(path)
    if (path / META_FILE).exists():
        raise FileExistsError(f"checkpoint {path} is already complete (it has {META_FILE}): save under a new path")
    meta_text = json.dumps(meta, indent=2, sort_keys=True)  # fail before writing anything if meta is not JSON
    model_state, optim_state = _trainable_state(model, optimizer)
    with _single_process_warning_silenced():
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(path))
    if _rank() == 0:
        _write_atomic(path / META_FILE, meta_text)
        _write_atomic(path.parent / LATEST_FILE, path.name)
    if dist.is_initialized():
        dist.barrier()  # no rank returns (and e.g. deletes an older checkpoint) before the pointer moved
    return path


def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Load the checkpoint at `path` into `model` and `optimizer` in place (collective); returns its meta."""
    path = Path(path)
    meta_path = path / META_FILE
    if not meta_path.exists():
        raise FileNotFoundError(
            f"{meta_path} does not exist: {path} is not a complete checkpoint (an interrupted save?); "
            f"use latest_checkpoint({str(path.parent)!r}) to find the newest complete one"
        )
    # A fresh optimizer has no state; get_state_dict creates it (a zero-lr step) so DCP has tensors to load into.
    model_state, optim_state = _trainable_state(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    with _single_process_warning_silenced():
        dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=_LOADED)
    return json.loads(meta_path.read_text())


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root` (what `latest` names), or None when there is none yet."""
    pointer = Path(root) / LATEST_FILE
    if not pointer.exists():
        return None
    path = Path(root) / pointer.read_text().strip()
    if not (path / META_FILE).exists():
        raise FileNotFoundError(
            f"{pointer} names {path.name}, which has no {META_FILE}: the checkpoint was removed after it was "
            f"committed; delete {pointer} to start fresh or point it at a complete checkpoint"
        )
    return path


def prune_checkpoints(root: str | Path, keep: int) -> list[Path]:
    """Keep the checkpoint `latest` names and the `keep` - 1 complete ones before it; delete the other complete ones
    before it and the remnants of interrupted saves before it. Return what was deleted. `keep` <= 0 keeps everything.

    Nothing after `latest` is touched (e.g. the checkpoints of a lineage an operator rolled back from). Call it on
    one rank after `save_checkpoint` returned (its barrier means no rank is still writing). Directories are ordered
    by the step number in their names (`checkpoint_dir`).
    """
    if keep <= 0:
        return []
    newest = latest_checkpoint(root)
    if newest is None:
        return []
    dirs = sorted((p for p in Path(root).iterdir() if _step_of(p) is not None), key=_step_of)
    older = [p for p in dirs if (p / META_FILE).exists() and _step_of(p) < _step_of(newest)]
    keep_set = set([*older, newest][-keep:])
    doomed = [p for p in dirs if p not in keep_set and _step_of(p) < _step_of(newest)]
    for path in doomed:
        shutil.rmtree(path)
    return doomed


def _step_of(path: Path) -> int | None:
    tail = path.name.removeprefix("step-")
    return int(tail) if path.name.startswith("step-") and tail.isdigit() and path.is_dir() else None


def checkpoint_dir(root: str | Path, step: int) -> Path:
    """The conventional directory for the checkpoint after `step`: root/step-00000042."""
    return Path(root) / f"step-{step:08d}"


def _trainable_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """`get_state_dict`'s model and optimizer state without the frozen parameters (see the module docstring).

    Filtered here rather than with StateDictOptions(ignore_frozen_params=True): that drops each frozen parameter
    under one name, and a tied LM head's other name (`lm_head.weight`, the embedding) would stay in."""
    model_state, optim_state = get_state_dict(model, optimizer)
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in model_state.items() if k not in frozen}, optim_state


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one, never a partial one


@contextlib.contextmanager
def _single_process_warning_silenced() -> Iterator[None]:
    """DCP warns that it assumes a single process when torch.distributed is not initialised; that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield
