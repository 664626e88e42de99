"""Runs learner/triton_kernels.py:row_pass in Triton's interpreter on CPU tensors, for test_fused_loss.py.

A separate process because Triton chooses between compiling and interpreting when `@triton.jit` decorates the kernel,
i.e. when learner.triton_kernels is first imported; TRITON_INTERPRET=1 must be set before that. Inputs and outputs go
through safetensors files (no pickle).

    TRITON_INTERPRET=1 python tests/learner/interpret_row_kernel.py IN.safetensors OUT.safetensors TEMPERATURE
"""

from __future__ import annotations

import os
import sys

import torch
from safetensors.torch import load_file, save_file

from learner.fused_loss import _params
from learner.losses import LOSS_KINDS, LossConfig


def main(source: str, target: str, temperature: float) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("TRITON_INTERPRET is not '1': the kernel would be compiled for a GPU; set TRITON_INTERPRET=1")
    from learner.triton_kernels import row_pass  # after the check: the decorator reads TRITON_INTERPRET

    inputs = load_file(source)
    rows = inputs["logits"].shape[0]
    outputs = {}
    for kind in LOSS_KINDS:  # each with the default LossConfig's trust region
        p1, p2 = _params(LossConfig(kind))
        logits = inputs["logits"].clone()  # overwritten with the logit gradient
        logp, loss = torch.empty(rows), torch.empty(rows)
        hit = torch.empty(rows, dtype=torch.int8)
        row_pass(logits, inputs["targets"], inputs["behaviour"], inputs["adv"], inputs["weight"], logp, loss, hit,
                 temperature, kind, p1, p2, True)  # fmt: skip
        outputs.update({f"{kind}.grad": logits, f"{kind}.logp": logp, f"{kind}.loss": loss, f"{kind}.hit": hit})
    save_file(outputs, target)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
