"""Checkpoints in one process (learner/checkpoint.py): exact round trip, meta, and the `latest` commit pointer.

The sharded (2-rank) round trip is in test_distributed.py; here DCP runs without torch.distributed initialised.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import learner.checkpoint as checkpoint
from learner.checkpoint import checkpoint_dir, latest_checkpoint, load_checkpoint, save_checkpoint


def tied_model(seed: int) -> torch.nn.Module:
    """Embedding and output layer sharing one weight, like a tied LM head."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50))
    model[1].weight = model[0].weight
    return model


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    tokens = torch.arange(12) % 50
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(tokens), (tokens + 1) % 50)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def fresh(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = tied_model(seed)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def saved(root: Path, step: int, meta: dict | None = None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, optimizer = fresh(0)
    train(model, optimizer, step)
    save_checkpoint(checkpoint_dir(root, step), model, optimizer, meta or {"version": step})
    return model, optimizer


def test_round_trip_restores_params_optimizer_state_and_meta_exactly(tmp_path: Path) -> None:
    meta = {"version": 3, "rollout_position": 96, "config": {"lr": 1e-2, "loss": "tis"}}
    model, optimizer = saved(tmp_path, 3, meta)
    restored, restored_optimizer = fresh(seed=1)  # different weights, no optimizer state yet

    assert load_checkpoint(latest_checkpoint(tmp_path), restored, restored_optimizer) == meta

    assert restored[1].weight is restored[0].weight  # the tie survives loading in place
    for a, b in zip(model.state_dict().values(), restored.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    train(model, optimizer, 1)
    train(restored, restored_optimizer, 1)
    for a, b in zip(model.parameters(), restored.parameters(), strict=True):
        assert torch.equal(a, b)  # identical Adam moments and step count give an identical next step


def test_latest_is_none_before_any_save_and_follows_each_save(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    saved(tmp_path, 1)
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 1)
    saved(tmp_path, 2)
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 2)
    assert (tmp_path / "latest").read_text() == "step-00000002"


def test_meta_and_pointer_are_written_only_after_the_shards(tmp_path: Path, monkeypatch) -> None:
    saved(tmp_path, 1)
    real_save, seen = checkpoint.dcp.save, {}

    def observing_save(state, checkpoint_id):
        seen["meta_before_shards"] = (Path(checkpoint_id) / "meta.json").exists()
        seen["latest_before_shards"] = latest_checkpoint(tmp_path)
        return real_save(state, checkpoint_id=checkpoint_id)

    monkeypatch.setattr(checkpoint.dcp, "save", observing_save)
    saved(tmp_path, 2)
    assert seen == {"meta_before_shards": False, "latest_before_shards": checkpoint_dir(tmp_path, 1)}


def test_interrupted_save_is_never_picked_up(tmp_path: Path, monkeypatch) -> None:
    saved(tmp_path, 1)

    def dying_save(state, checkpoint_id):
        Path(checkpoint_id).mkdir(parents=True)
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"half a shard")
        raise RuntimeError("killed mid-save")

    monkeypatch.setattr(checkpoint.dcp, "save", dying_save)
    with pytest.raises(RuntimeError, match="killed"):
        saved(tmp_path, 2)

    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 1)
    model, optimizer = fresh(0)
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        load_checkpoint(checkpoint_dir(tmp_path, 2), model, optimizer)
    monkeypatch.undo()
    saved(tmp_path, 2)  # the partial directory may be reused by the retried save
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 2)


def test_saving_over_a_complete_checkpoint_raises(tmp_path: Path) -> None:
    saved(tmp_path, 1)
    with pytest.raises(FileExistsError, match="already complete"):
        saved(tmp_path, 1)


def test_meta_that_is_not_json_raises_before_anything_is_written(tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        saved(tmp_path, 1, meta={"config": object()})
    assert list(tmp_path.iterdir()) == []


def test_pointer_to_a_removed_checkpoint_raises_naming_it(tmp_path: Path) -> None:
    saved(tmp_path, 1)
    (checkpoint_dir(tmp_path, 1) / "meta.json").unlink()
    with pytest.raises(FileNotFoundError, match="step-00000001"):
        latest_checkpoint(tmp_path)


def test_prune_keeps_the_newest_complete_and_drops_older_remnants(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        saved(tmp_path, step)
    remnant = checkpoint_dir(tmp_path, 0)  # an interrupted save older than the newest complete one
    remnant.mkdir()
    (remnant / "__0_0.distcp").write_bytes(b"partial")
    stray = tmp_path / "notes"  # not a checkpoint: never touched
    stray.mkdir()
    saved(tmp_path, 4)

    deleted = checkpoint.prune_checkpoints(tmp_path, keep=2)

    assert sorted(p.name for p in deleted) == ["step-00000000", "step-00000001", "step-00000002"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["notes", "step-00000003", "step-00000004"]
    model, optimizer = fresh(1)
    assert load_checkpoint(latest_checkpoint(tmp_path), model, optimizer)["version"] == 4
    assert checkpoint.prune_checkpoints(tmp_path, keep=2) == []  # idempotent


def test_prune_never_touches_latest_or_later_ones_and_keep_zero_keeps_all(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        saved(tmp_path, step)
    assert checkpoint.prune_checkpoints(tmp_path, keep=0) == []
    (tmp_path / "latest").write_text("step-00000001")  # e.g. an operator rolled back to an older checkpoint
    assert checkpoint.prune_checkpoints(tmp_path, keep=1) == []  # nothing after latest is touched
    assert latest_checkpoint(tmp_path).name == "step-00000001"
    assert len(list(tmp_path.glob("step-*"))) == 3
    assert checkpoint.prune_checkpoints(tmp_path, keep=1) == []
