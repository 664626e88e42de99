"""`torchrun --nproc-per-node 2 -m inflight.learn` trains exactly like one process on the same rollouts (gloo, CPU).

No engine needed: the test plays the serve's part on a real PUSH socket, sending the same recorded rollouts to a
1-process learner and to a 2-rank torchrun learner; both export `hf-final`, which must agree within a fraction of lr.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import torch
from safetensors.torch import load_file
from test_serve import free_port

from inflight.wire.rollouts import Sampling, Times, encode_rollout, make_rollout

LR = 1e-3


def rollouts(seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    out = []
    for g in range(2):
        prompt = rng.integers(10, 1000, size=7).tolist()
        for i in range(4):
            n = int(rng.integers(3, 9))
            out.append(encode_rollout(make_rollout(
                prompt_ids=prompt, completion_ids=rng.integers(10, 1000, size=n).tolist(),
                logprobs=(-rng.uniform(4, 9, size=n)).tolist(), versions=[0] * n, rollout_id=f"g{g}-{i}",
                group_id=f"g{g}", group_size=4, index=i, server_id="test", model="tiny-llama",
                reward=float(rng.integers(0, 2)) + 0.1 * i, finish_reason="length", sampling=Sampling(1.0),
                times=Times(0.0, 0.0, 0.0))))  # fmt: skip
    return out


def run_learner(launcher: list[str], model_dir, run_dir) -> None:
    import zmq

    ports = [free_port() for _ in range(3)]
    args = ["-m", "inflight.learn", "--model", str(model_dir), "--steps", "1", "--groups-per-step", "2", "--lr",
            str(LR), "--run-dir", str(run_dir), "--rollouts-port", str(ports[0]), "--control-port", str(ports[1]),
            "--weights-port", str(ports[2]), "--wait-for-serves", "0", "--autocast", "none"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([*launcher, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{ports[0]}")
    for record in rollouts():
        push.send(record)
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        push.close(linger=0)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]


def test_torchrun_two_gloo_ranks_train_like_one_process(model_dirs, tmp_path):
    torchrun = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc-per-node", "2", "--master-port",
                str(free_port())]  # fmt: skip
    start = time.monotonic()
    run_learner([sys.executable], model_dirs["tiny-llama"], tmp_path / "one")
    run_learner(torchrun, model_dirs["tiny-llama"], tmp_path / "two")
    base = load_file(str(model_dirs["tiny-llama"] / "model.safetensors"))
    one = load_file(str(tmp_path / "one" / "hf-final" / "model.safetensors"))
    two = load_file(str(tmp_path / "two" / "hf-final" / "model.safetensors"))
    assert one.keys() == two.keys() == base.keys()
    moved = max((one[k].float() - base[k].float()).abs().max().item() for k in one)
    worst = max((one[k] - two[k]).abs().max().item() for k in one)
    print(f"\nlargest update {moved:.2e}, largest 1-vs-2-rank difference {worst:.2e} ({time.monotonic() - start:.0f}s)")
    assert moved > 0.5 * LR  # the step really trained
    assert worst <= 0.1 * LR
    assert all(torch.equal(one[k].isfinite(), two[k].isfinite()) for k in one)
