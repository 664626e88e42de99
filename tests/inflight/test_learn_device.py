"""`inflight.learn --device`: where the learner trains is decided at start, and a placement that cannot work stops it
there, before any model, socket or run-directory file (learner/world.py)."""

from __future__ import annotations

import pytest
import torch

from inflight.learn.app import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour of a machine without CUDA")
def test_device_cuda_on_a_machine_without_cuda_exits_at_start_naming_the_flag_and_the_fix(tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["--device", "cuda", "--run-dir", str(tmp_path / "run"), "--rollouts-port", "1", "--control-port", "1"])
    message = str(stopped.value.code)
    assert message.startswith("inflight.learn: --device is 'cuda', but torch sees no CUDA device"), message
    assert "pass --device cpu (or auto)" in message
    assert not (tmp_path / "run").exists()  # nothing was written, nothing bound (port 1 would have failed)


def test_nccl_weights_from_a_learner_on_the_cpu_exit_at_start_naming_both_flags(tmp_path):
    with pytest.raises(SystemExit, match=r"--backend is 'nccl', but the learner runs on the CPU \(--device cpu\)"):
        main(["--device", "cpu", "--backend", "nccl", "--run-dir", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()
