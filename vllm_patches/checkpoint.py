"""ServedCheckpoint: the checkpoint a serve worker was started from, read from its safetensors files.

Owned by the worker's update state (vllm_patches/worker_extension.py:WorkerUpdateState). Two readers: an update's
manifest is checked against `expected()` before any bucket moves, and the in-place commit path rolls back to
`tensors()` when it holds no whole tensors of the live version (vllm_patches/commit.py:LiveWeights).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open

from inflight.wire.weights import ManifestError

_SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}
_FLOATS = frozenset(_SAFETENSORS_DTYPES.values())


class ServedCheckpoint:
    """The local HF directory `model_dir` served in `served_dtype` (the engine's compute dtype, e.g. "bfloat16")."""

    def __init__(self, model_dir: str, served_dtype: str):
        self.model_dir, self.served_dtype = model_dir, served_dtype
        self._expected: dict[str, tuple[str, list[int]]] | None = None

    def expected(self) -> dict[str, tuple[str, list[int]]]:
        """HF name → (dtype, shape) of every tensor in the checkpoint: what an update must contain (read once).

        Floating-point tensors are expected in the dtype the engine computes in (an fp32 engine serving a bf16
        checkpoint takes fp32 updates, so the learner's weights arrive unrounded); others as stored.
        """
        if self._expected is None:
            expected = {}
            for path in self.files():
                with safe_open(path, "pt") as f:
                    for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                        sl = f.get_slice(name)
                        dtype = _SAFETENSORS_DTYPES.get(sl.get_dtype(), sl.get_dtype())
                        expected[name] = (self.served_dtype if dtype in _FLOATS else dtype, list(sl.get_shape()))
            self._expected = expected
        return self._expected

    def files(self) -> list[str]:
        files = sorted(glob.glob(os.path.join(self.model_dir, "*.safetensors")))
        if not files:
            raise ManifestError(f"no *.safetensors in {self.model_dir}: serve a local HF directory")
        return files

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor of the checkpoint as stored, one at a time."""
        for path in self.files():
            with safe_open(path, "pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    yield name, f.get_tensor(name)
